"""Pipelined versus synchronous RL on the embedded default, same machine, same wall clock.

    python bench/pipeline_bench.py [--budget-s 240]

Runs `rlpipe demo` twice through the launcher, each for the same budget:
- sync:  trainer max_staleness=0 and the feeder publishing one batch per policy version, so
         workers wait for each update and the trainer waits for each batch;
- async: trainer max_staleness=4 and the feeder keeping the task queue full, so both tiers
         work at the same time.
From each run's `trainer/steps.jsonl` it reports reward versus time, trained samples/s, the
time to reach a mean reward of 0.5 and 0.8, and the trainer's busy fraction; then the
async/sync ratios. Results: bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from libs.launcher.run import LaunchOptions, run_local

RESULTS = Path(__file__).parent / "results" / "pipeline.json"

MODES: dict[str, dict[str, dict[str, str]]] = {
    "sync": {
        "trainer": {"RLPIPE_TRAINER_MAX_STALENESS": "0"},
        "env-gateway": {"RLPIPE_ENV_GATEWAY_FEEDER_MODE": "sync"},
    },
    "async": {
        "trainer": {"RLPIPE_TRAINER_MAX_STALENESS": "4"},
        "env-gateway": {"RLPIPE_ENV_GATEWAY_FEEDER_MODE": "async"},
    },
}


def run_mode(mode: str, budget_s: float, root: Path) -> dict[str, Any]:
    run_dir = root / mode
    started = time.time()
    code = run_local(LaunchOptions(run_dir=run_dir, duration_s=budget_s, extra_env=MODES[mode]))
    steps_path = run_dir / "trainer" / "steps.jsonl"
    records = (
        [json.loads(line) for line in steps_path.read_text().splitlines()]
        if steps_path.exists()
        else []
    )
    return summarize(mode, code, started, records, budget_s)


def summarize(
    mode: str, exit_code: int, started: float, records: list[dict[str, Any]], budget_s: float
) -> dict[str, Any]:
    curve = [(round(r["time"] - started, 2), round(r["mean_reward"], 4)) for r in records]
    samples = sum(r["num_samples"] for r in records)
    last = records[-10:]
    return {
        "mode": mode,
        "exit_code": exit_code,
        "steps": len(records),
        "samples_trained": samples,
        "samples_per_s": round(samples / budget_s, 2),
        "reward_first_10": _mean([r["mean_reward"] for r in records[:10]]),
        "reward_last_10": _mean([r["mean_reward"] for r in last]),
        "time_to_reward_0.5_s": _first_time(curve, 0.5),
        "time_to_reward_0.8_s": _first_time(curve, 0.8),
        "trainer_busy_fraction": records[-1]["busy_fraction"] if records else None,
        "dropped_samples": sum(r["num_dropped"] for r in records),
        "mean_staleness": _mean_staleness(records),
        "reward_vs_time_s": curve,
    }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _first_time(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """First time the mean reward over a window of 5 steps reaches `threshold`."""
    for end in range(5, len(curve) + 1):
        window = curve[end - 5 : end]
        if sum(r for _, r in window) / 5 >= threshold:
            return window[-1][0]
    return None


def _mean_staleness(records: list[dict[str, Any]]) -> float | None:
    total = count = 0
    for record in records:
        for staleness, n in record["staleness"].items():
            total += int(staleness) * n
            count += n
    return round(total / count, 3) if count else None


def ratios(sync: dict[str, Any], pipelined: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "samples_per_s_async_over_sync": ratio(pipelined["samples_per_s"], sync["samples_per_s"]),
        "time_to_0.8_sync_over_async": ratio(
            sync["time_to_reward_0.8_s"], pipelined["time_to_reward_0.8_s"]
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall clock per mode")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlpipe-pipeline-") as root:
        results = {mode: run_mode(mode, args.budget_s, Path(root)) for mode in ("sync", "async")}
    document = {
        "benchmark": "pipeline",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "budget_s": args.budget_s,
        "modes": results,
        "ratios": ratios(results["sync"], results["async"]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(
        f"{'mode':6} {'steps':>6} {'samples/s':>10} {'reward last10':>14} "
        f"{'t->0.8 s':>9} {'busy':>6}"
    )
    for mode, r in results.items():
        print(
            f"{mode:6} {r['steps']:>6} {r['samples_per_s']:>10} {r['reward_last_10']!s:>14} "
            f"{r['time_to_reward_0.8_s']!s:>9} {r['trainer_busy_fraction']!s:>6}"
        )
    print(f"pipeline ratios: {json.dumps(document['ratios'])}")
    print(f"wrote {args.out}")
    return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
