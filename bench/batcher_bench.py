"""The rollout-worker's event loop under a continuous-batching engine: what each call costs it.

With the paged engine every request is its own engine call (one per sample on the GPU
loop's arith task, hundreds a second), and each call passes through the batcher and its
throughput meter on the worker's event loop, which also reads weight announcements and
serves the bus. This drives `GenerationBatcher` with N concurrent episodes against an
engine that answers each call after a uniform 0.2-0.6 s (its thread sleeps: no CPU), and
measures calls per second, the event-loop thread's CPU per call (and the whole process's:
threads that hand calls over count there), and how late a 10 ms
sleep on the loop wakes up (p50, p99): the loop's responsiveness.

    .venv/bin/python bench/batcher_bench.py [--episodes 500] [--seconds 20] [--out FILE]

Writes bench/results/<machine>/batcher.json. CPU only; part of `make bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import platform
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from result_file import result_file, result_json

from libs.engine.base import Completion, SamplingParams
from libs.rollout.batcher import GenerationBatcher


class SleepingEngine:
    """A continuous-batching engine stand-in whose calls take 0.2-0.6 s of wall time: one
    thread of its own resolves each call's future when it is due, as the paged engine's
    driver does (it sleeps meanwhile: no CPU)."""

    continuous_batching = True
    policy_version = 0

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Future[list[Completion]], int]] = []
        self._changed = threading.Condition()
        self._count = 0
        threading.Thread(target=self._drive, daemon=True).start()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[Completion]:
        return self.submit(prompts, params, num_samples).result()

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> Future[list[Completion]]:
        future: Future[list[Completion]] = Future()
        future.set_running_or_notify_cancel()
        with self._changed:
            self._count += 1
            due = time.monotonic() + random.uniform(0.2, 0.6)
            heapq.heappush(self._due, (due, self._count, future, len(prompts)))
            self._changed.notify()
        return future

    def _drive(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, future, rows = heapq.heappop(self._due)
            future.set_result(
                [Completion(i, 0, [1, 2], [0.0, 0.0], [0.0, 0.0], "stop", 0) for i in range(rows)]
            )


async def measure(episodes: int, seconds: float) -> dict[str, Any]:
    batcher = GenerationBatcher(SleepingEngine())  # type: ignore[arg-type]
    batcher.open.set()
    runner = asyncio.create_task(batcher.run())
    calls = 0
    lags: list[float] = []

    async def episode() -> None:
        nonlocal calls
        while True:
            await batcher.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            calls += 1

    async def probe() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - started - 0.01)

    tasks = [asyncio.create_task(episode()) for _ in range(episodes)]
    tasks.append(asyncio.create_task(probe()))
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    process_start = time.process_time()
    await asyncio.sleep(seconds)
    wall, cpu = time.perf_counter() - wall_start, time.thread_time() - cpu_start
    process_cpu = time.process_time() - process_start
    for task in [*tasks, runner]:
        task.cancel()
    await asyncio.gather(*tasks, runner, return_exceptions=True)
    lags.sort()
    return {
        "episodes": episodes,
        "seconds": seconds,
        "calls_per_s": round(calls / wall, 1),
        "ceiling_calls_per_s": round(episodes / 0.4, 1),  # every call 0.4 s on average
        "event_loop_cpu_per_s": round(cpu / wall, 3),
        "event_loop_cpu_us_per_call": round(cpu / max(calls, 1) * 1e6, 1),
        "process_cpu_us_per_call": round(process_cpu / max(calls, 1) * 1e6, 1),
        "wake_up_lag_ms_p50": round(lags[len(lags) // 2] * 1e3, 2),
        "wake_up_lag_ms_p99": round(lags[int(len(lags) * 0.99)] * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=result_file("batcher"))
    args = parser.parse_args()
    result = asyncio.run(measure(args.episodes, args.seconds))
    result["machine"] = f"{platform.machine()}, {platform.processor() or 'cpu'}"
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result_json(result))


if __name__ == "__main__":
    main()
