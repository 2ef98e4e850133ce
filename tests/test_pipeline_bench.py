"""The pipeline benchmark's comparison (bench/pipeline_bench.py, bench/pipeline_figures.py):
what each mode runs, and how its figures are counted.

Run: .venv/bin/python -m pytest tests/test_pipeline_bench.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from apps.launcher.recipe import load_recipe
from apps.launcher.warm_start import warm_start_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import pipeline_bench  # noqa: E402
from pipeline_figures import ratios, summarize  # noqa: E402


def step(time: float, reward: float, samples: int = 16, staleness: int = 0) -> dict[str, Any]:
    """A trainer step record with the fields the figures read."""
    return {
        "time": time,
        "mean_reward": reward,
        "num_samples": samples,
        "num_dropped": 0,
        "staleness": {str(staleness): samples},
        "busy_fraction": 0.5,
        "step_s": 0.5,
        "wait_s": 0.5,
    }


def test_calc_on_the_gpu_starts_from_the_cpu_recipes_warm_start(tmp_path: Path) -> None:
    cpu = load_recipe(REPO / "libs" / "domains" / "calc" / "recipe.toml")
    gpu = load_recipe(REPO / "libs" / "domains" / "calc" / "gpu.toml")
    assert cpu.warm_start is not None and gpu.warm_start is not None
    assert warm_start_dir("calc", tmp_path, gpu.warm_start) == warm_start_dir(
        "calc", tmp_path, cpu.warm_start
    ), "one cached build serves both"
    assert gpu.warm_start.rl == cpu.warm_start.rl, "the same RL from it"
    assert gpu.tables["rollout_worker"]["engine"]["type"] == "paged"
    assert gpu.tables["trainer"]["batch_groups"] == cpu.tables["trainer"]["batch_groups"]


def options_of(name: str, mode: str, **bench: Any) -> dict[str, Any]:
    options = pipeline_bench.BenchOptions(budget_s=60, **bench)
    scenario = pipeline_bench.SCENARIOS[name]
    launch = pipeline_bench.scenario_options(scenario, mode, Path("/tmp/x"), options)
    return dict(launch.recipe)


def test_the_synchronous_baseline_stays_synchronous_whatever_is_set() -> None:
    tables = pipeline_bench.command_tables("cpu", ["trainer.max_staleness=3"])
    recipe = options_of("arith-gpu", "sync", tables=tables)
    assert recipe["trainer"]["max_staleness"] == 0
    assert recipe["env_gateway"]["feeder"]["mode"] == "sync"
    assert recipe["trainer"]["policy"]["device"] == "cpu", "--device reaches the trainer"
    assert recipe["weight_broadcaster"]["diff_device"] == "cpu"


def test_the_gpu_pipeline_keeps_the_trainers_staleness_bound_unless_told() -> None:
    assert "max_staleness" not in options_of("arith-gpu", "async")["trainer"]
    assert options_of("arith-gpu", "async", max_staleness=2)["trainer"]["max_staleness"] == 2
    assert options_of("arith", "async")["trainer"]["max_staleness"] == 4, "the CPU figure's"


def test_set_values_are_typed_as_a_recipe_would_write_them() -> None:
    tables = pipeline_bench.command_tables(
        None, ["rollout-worker.engine.max_batch_rows=128", "trainer.learning_rate=1e-4"]
    )
    assert tables == {
        "rollout_worker": {"engine": {"max_batch_rows": 128}},
        "trainer": {"learning_rate": 1e-4},
    }


def test_the_threshold_is_crossed_when_the_10_step_mean_goes_above_it() -> None:
    records = [step(100.0 + i, 0.0) for i in range(5)] + [step(105.0 + i, 1.0) for i in range(20)]
    figures = summarize("async", 0, 90.0, records, budget_s=60, threshold=0.8)
    # Steps 6.. reward 1: the mean of steps 5-14 is 0.9, of steps 4-13 exactly 0.8 (not above).
    assert figures["steps_to_threshold"] == 14
    assert figures["samples_to_threshold"] == 14 * 16
    # Step 14 ends at 113; the trainer started at 99 (its first step's start less its wait).
    assert figures["time_to_threshold_s"] == 14.0
    assert figures["time_to_threshold_from_launch_s"] == 23.0
    assert figures["trainer_started_s"] == 9.0
    assert figures["reward_vs_samples"][:2] == [(16, 0.0), (32, 0.0)]
    never = summarize("sync", 0, 100.0, records[:8], budget_s=60, threshold=0.8)
    assert never["time_to_threshold_s"] is never["steps_to_threshold"] is None


def test_a_speedup_is_a_lower_bound_when_only_the_pipeline_gets_there() -> None:
    fast = [step(100.0 + i, 1.0) for i in range(12)]
    slow = [step(100.0 + 10 * i, 0.5) for i in range(6)]
    pipelined = summarize("async", 0, 89.0, fast, budget_s=60, threshold=0.8)
    sync = summarize("sync", 0, 89.0, slow, budget_s=60, threshold=0.8)
    found = ratios(sync, pipelined, goal_speedup=2.5)
    assert found["time_to_threshold_sync_over_async"] is None
    # The pipeline: 10 s from its trainer's start; sync trained 50 s of its budget without.
    assert found["time_to_threshold_sync_over_async_at_least"] == 5.0
    assert found["goal"]["met"] is True
    both = ratios(pipelined, pipelined, goal_speedup=1.5)
    assert both["time_to_threshold_sync_over_async"] == 1.0 and both["goal"]["met"] is False
