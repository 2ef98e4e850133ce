"""Benchmark the bubblewrap sandbox: start latency and many sandboxes at once.

- start latency: `true` run end to end through `Sandbox.run` (spawn bubblewrap, namespaces,
  mounts, prlimit, exec, exit, pipes drained), sequentially in one sandbox; also a whole
  episode's overhead (open: copy the seed; run `true`; close: kill, remove the folder);
- concurrency: N sandboxes opened at once, each running a short python command.

    .venv/bin/python bench/sandbox_bench.py [--runs 200] [--concurrent 64]

Writes bench/results/<machine>/sandbox.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from result_file import git_commit, result_file, result_json

from libs.sandbox import SandboxConfig, SandboxFactory, build_sandbox_factory

RESULTS = result_file("sandbox")
PYTHON_COMMAND = ["python3", "-c", "print(sum(range(100_000)))"]
HOLD_S = 2.0
HOLD_COMMAND = ["python3", "-c", f"import time; time.sleep({HOLD_S}); print(4999950000)"]


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median, p99 and max of samples in seconds, as milliseconds."""
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


async def start_latency(factory: SandboxFactory, runs: int) -> dict[str, float]:
    samples = []
    async with factory.open() as sandbox:
        for _ in range(runs):
            started = time.perf_counter()
            result = await sandbox.run(["true"])
            samples.append(time.perf_counter() - started)
            assert result.ok, result.stderr
    return summary_ms(samples)


async def episode_overhead(factory: SandboxFactory, seed: Path, runs: int) -> dict[str, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        async with factory.open(seed) as sandbox:
            assert (await sandbox.run(["true"])).ok
        samples.append(time.perf_counter() - started)
    return summary_ms(samples)


async def concurrency(
    factory: SandboxFactory, seed: Path, count: int, command: list[str]
) -> dict[str, Any]:
    async def one() -> tuple[bool, float]:
        started = time.perf_counter()
        async with factory.open(seed) as sandbox:
            result = await sandbox.run(command)
        return result.ok and result.stdout == b"4999950000\n", time.perf_counter() - started

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one() for _ in range(count)))
    total_s = time.perf_counter() - started
    return {
        "sandboxes": count,
        "succeeded": sum(ok for ok, _ in outcomes),
        "total_wall_s": round(total_s, 3),
        "per_sandbox": summary_ms([latency for _, latency in outcomes]),
    }


async def python_alone(factory: SandboxFactory, runs: int) -> dict[str, float]:
    """The command's own cost, sequentially, to read the concurrency figures against."""
    samples = []
    async with factory.open() as sandbox:
        for _ in range(runs):
            started = time.perf_counter()
            assert (await sandbox.run(PYTHON_COMMAND)).ok
            samples.append(time.perf_counter() - started)
    return summary_ms(samples)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    factory = build_sandbox_factory(SandboxConfig())
    with tempfile.TemporaryDirectory() as tmp:
        seed = Path(tmp)
        for i in range(10):  # a small task: ten source files
            (seed / f"module_{i}.py").write_text(f"VALUE = {i}\n" * 50)
        await start_latency(factory, 20)  # warm caches
        report: dict[str, Any] = {
            "git_commit": git_commit(),
            # What confines each sandbox here (cgroup totals, seccomp, disk quota): the
            # figures include making and removing its cgroup where there is one.
            "enforcement": dict(factory.enforcement),
            "start_latency_true": await start_latency(factory, args.runs),
            "episode_open_run_close": await episode_overhead(factory, seed, args.runs // 4),
            "python_command_sequential": await python_alone(factory, 20),
            "concurrency": await concurrency(factory, seed, args.concurrent, PYTHON_COMMAND),
            # Every sandbox alive at once: each python sleeps HOLD_S before answering.
            f"concurrency_all_alive_sleep_{HOLD_S}s": await concurrency(
                factory, seed, args.concurrent, HOLD_COMMAND
            ),
        }
        if args.parent_mib:
            ballast = bytearray(args.parent_mib << 20)  # touched: a service with a model loaded
            for offset in range(0, len(ballast), 4096):
                ballast[offset] = 1
            report[f"start_latency_true_parent_{args.parent_mib}mib"] = await start_latency(
                factory, args.runs // 4
            )
            del ballast
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument(
        "--parent-mib", type=int, default=1024, help="re-measure start with a parent this big"
    )
    args = parser.parse_args()
    args.load_before = round(os.getloadavg()[0], 2)
    report = asyncio.run(main_async(args))
    report["machine"] = {
        "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "running_as_root": os.geteuid() == 0,
        # Other work on the machine skews every figure: read them against these.
        "load_average_1m_before": args.load_before,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(result_json(report))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
