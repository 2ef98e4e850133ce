"""The figures of bench/pipeline_bench.py: one mode's summary from the trainer's step records,
and the pipelined/synchronous ratios of a scenario.

    summary = summarize("async", 0, launched_at, records, budget_s=150, threshold=0.8)
    ratios(sync_summary, async_summary, goal)

A step record is a line of the run's `trainer/steps.jsonl` (libs/trainer/metrics.py). The
curves and the `time_to_reward_*` fields count seconds from the launch of the run (services
started, the warm start already built); `time_to_threshold_s` counts from the trainer's start
(its first step's start less the wait before it, as bench/gpu_loop.sh and issue 29's table
count), so the models' load, the same in both modes, does not thin the speedup out;
`trainer_started_s` is that start from the launch. The threshold is crossed at the first step
whose mean reward over the last 10 steps is above it; the 5-step window of the older
`time_to_reward_*` fields stays for the CPU figures already cited.
"""

from __future__ import annotations

from typing import Any

WINDOW_STEPS = 10


def summarize(
    mode: str,
    exit_code: int,
    started: float,
    records: list[dict[str, Any]],
    budget_s: float,
    thresholds: tuple[float, float] = (0.5, 0.8),
    threshold: float = 0.8,
) -> dict[str, Any]:
    """One mode's figures; the curves hold one point per trainer step."""
    curve = [(round(r["time"] - started, 2), round(r["mean_reward"], 4)) for r in records]
    samples = sum(r["num_samples"] for r in records)
    dropped = sum(r["num_dropped"] for r in records)
    low, high = thresholds
    return {
        "mode": mode,
        "exit_code": exit_code,
        "budget_s": budget_s,
        "steps": len(records),
        "samples_trained": samples,
        "samples_per_s": round(samples / budget_s, 2),
        "reward_first_10": _mean([r["mean_reward"] for r in records[:10]]),
        "reward_last_10": _mean([r["mean_reward"] for r in records[-10:]]),
        "thresholds": list(thresholds),
        "time_to_reward_low_s": _first_time(curve, low),
        "time_to_reward_high_s": _first_time(curve, high),
        "trainer_busy_fraction": records[-1]["busy_fraction"] if records else None,
        "dropped_samples": dropped,
        "dropped_fraction": round(dropped / (samples + dropped), 4) if samples + dropped else None,
        "mean_staleness": _mean_staleness(records),
        "trainer_started_s": round(trainer_start(records) - started, 2) if records else None,
        **threshold_crossing(records, started, threshold),
        "reward_vs_time_s": curve,
        "reward_vs_samples": reward_vs_samples(records),
    }


def trainer_start(records: list[dict[str, Any]]) -> float:
    """When the trainer began waiting for its first batch (Unix time)."""
    first = records[0]
    return float(first["time"] - first["step_s"] - first["wait_s"])


def threshold_crossing(
    records: list[dict[str, Any]], launched: float, threshold: float
) -> dict[str, Any]:
    """When the 10-step mean reward first went above `threshold`: seconds from the trainer's
    start and from the launch, steps, samples (None each when it never did)."""
    samples = 0
    for end, record in enumerate(records, start=1):
        samples += record["num_samples"]
        if end < WINDOW_STEPS:
            continue
        window = records[end - WINDOW_STEPS : end]
        if sum(r["mean_reward"] for r in window) / WINDOW_STEPS > threshold:
            return {
                "threshold": threshold,
                "time_to_threshold_s": round(record["time"] - trainer_start(records), 2),
                "time_to_threshold_from_launch_s": round(record["time"] - launched, 2),
                "steps_to_threshold": end,
                "samples_to_threshold": samples,
            }
    return {
        "threshold": threshold,
        "time_to_threshold_s": None,
        "time_to_threshold_from_launch_s": None,
        "steps_to_threshold": None,
        "samples_to_threshold": None,
    }


def reward_vs_samples(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(samples trained so far, the step's mean reward) per step."""
    curve, samples = [], 0
    for record in records:
        samples += record["num_samples"]
        curve.append((samples, round(record["mean_reward"], 4)))
    return curve


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


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(
    sync: dict[str, Any], pipelined: dict[str, Any], goal_speedup: float | None = None
) -> dict[str, Any]:
    """Pipelined against synchronous. The speedup is sync's time to the threshold over the
    pipeline's (above 1: the pipeline got there sooner); when only the pipeline got there,
    the synchronous run's budget over the pipeline's time is a lower bound of it."""
    sync_time, pipelined_time = (
        sync.get("time_to_threshold_s"),
        pipelined.get("time_to_threshold_s"),
    )
    speedup = _ratio(sync_time, pipelined_time)
    at_least = None
    if speedup is None and pipelined_time and not sync_time:
        # The synchronous run trained until its budget ran out: past the threshold, if ever.
        at_least = _ratio(
            sync.get("budget_s", 0) - (sync.get("trainer_started_s") or 0), pipelined_time
        )
    steps = _ratio(pipelined.get("steps_to_threshold"), sync.get("steps_to_threshold"))
    found = {
        "samples_per_s_async_over_sync": _ratio(pipelined["samples_per_s"], sync["samples_per_s"]),
        "time_to_high_sync_over_async": _ratio(
            sync["time_to_reward_high_s"], pipelined["time_to_reward_high_s"]
        ),
        "time_to_low_sync_over_async": _ratio(
            sync["time_to_reward_low_s"], pipelined["time_to_reward_low_s"]
        ),
        "time_to_threshold_sync_over_async": speedup,
        "time_to_threshold_sync_over_async_at_least": at_least,
        "steps_to_threshold_async_over_sync": steps,
        "samples_to_threshold_async_over_sync": _ratio(
            pipelined.get("samples_to_threshold"), sync.get("samples_to_threshold")
        ),
    }
    if goal_speedup is not None:
        found["goal"] = goal(goal_speedup, speedup or at_least, steps)
    return found


# Issue 29's bar: sample efficiency kept, the pipeline's steps to the threshold within this
# factor of the synchronous loop's.
MAX_STEPS_RATIO = 1.5


def goal(speedup_wanted: float, speedup: float | None, steps: float | None) -> dict[str, Any]:
    """Whether a scenario met its bar: the speedup wanted and steps within MAX_STEPS_RATIO."""
    met = None
    if speedup is not None:
        met = speedup >= speedup_wanted and (steps is None or steps <= MAX_STEPS_RATIO)
    return {"speedup": speedup_wanted, "steps_ratio_at_most": MAX_STEPS_RATIO, "met": met}
