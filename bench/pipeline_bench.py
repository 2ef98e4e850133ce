"""Pipelined versus synchronous RL, same machine, same wall clock, on the same workloads.

    python bench/pipeline_bench.py [--budget-s 240] [--scenarios arith,heavy-tail]
    python bench/pipeline_bench.py --scenarios arith-gpu --budget-s 150        # one GPU
    python bench/pipeline_bench.py --scenarios calc-gpu --modes sync --budget-s 240

Each scenario runs `rlpipe demo` twice through the launcher, back to back, each for the same
budget (the warm start, when the scenario has one, is built before either):
- sync:  trainer max_staleness=0, a version published after every step, and the feeder
         publishing one batch per policy version, so workers wait for each update and the
         trainer waits for each batch;
- async: the feeder keeping the task queue full, so both tiers work at the same time; the
         staleness bound is the scenario's (4 for the CPU scenarios, as measured) or the
         trainer's own (its default for the model, or its adaptive pacing) unless
         --max-staleness says one.
Scenarios (the CPU ones run by default):
- arith:      the embedded default (two-token episodes, no stragglers);
- heavy-tail: calc's recipe from its warm start (apps.launcher.warm_start), every tool call
              taking a lognormal latency (median 1 s, sigma 1.2, capped at 20 s:
              libs.envs.latency), so episodes have the long, uneven durations of agent work;
- arith-gpu:  arith on one GPU, byte-0.5b (libs/domains/arith/gpu.toml, bench/gpu_loop.sh's);
- calc-gpu:   heavy-tail on one GPU: libs/domains/calc/gpu.toml (the trainer on CUDA, the
              workers on the paged engine) from calc's CPU warm start.
From each run's `trainer/steps.jsonl` and logs it reports (bench/pipeline_figures.py) reward
against time and against samples trained, samples/s, trainer busy, the fraction dropped as
stale, the mean staleness of trained samples, the version latency median
(bench/version_latency.py), the time, steps and samples to a 10-step mean reward above the
scenario's threshold, and the async/sync ratios. --modes runs one mode alone (a GPU lease's
command limit); its result joins the other mode's already in the file. Results:
bench/results/<machine>/pipeline.json (the CUDA card's name when the run uses one;
bench/result_file.py), other scenarios in the file kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_figures import ratios, summarize
from result_file import result_file, result_json
from version_latency import PARTS, log_events, step_ends, timestamp, version_rows
from version_latency import summarize as latency_summary

from apps.launcher.arguments import domain_recipe
from apps.launcher.recipe import WarmStart, load_recipe, merge_tables
from apps.launcher.run import LaunchOptions, run_local
from apps.launcher.warm_start import default_cache_root, ensure_warm_start
from libs.settings import merge_overrides

REPO = Path(__file__).resolve().parent.parent

# Each mode's tables, over the scenario's and the command line's: what makes a mode wins.
MODES: dict[str, dict[str, Any]] = {
    "sync": {
        "trainer": {"max_staleness": 0, "publish_every_steps": 1},
        "env_gateway": {"feeder": {"mode": "sync"}},
    },
    "async": {"env_gateway": {"feeder": {"mode": "async"}}},
}

HEAVY_TAIL_TABLES: dict[str, Any] = {
    "env_gateway": {"tool_latency": "lognormal:median_s=1.0,sigma=1.2,max_s=20"},
    # The gate's held-out episodes would wait on the same tool latency between two steps.
    "trainer": {"eval": {"every_versions": 0}},
}


@dataclass(frozen=True)
class Scenario:
    """A workload: a recipe (the domain's own unless `recipe` names a file), tables over it,
    whether RL starts from the recipe's warm start, and how it is judged."""

    domain: str
    tables: dict[str, Any]
    thresholds: tuple[float, float]
    warm_start: bool = False
    recipe: str | None = None  # a recipe file, relative to the repository
    # The 10-step mean reward whose crossing is timed, and the speedup it is held to.
    threshold: float = 0.8
    goal_speedup: float | None = None
    # The pipelined mode's staleness bound; None: the trainer's own.
    pipelined_staleness: int | None = None

    def recipe_path(self) -> Path:
        return REPO / self.recipe if self.recipe else domain_recipe(self.domain)


SCENARIOS: dict[str, Scenario] = {
    "arith": Scenario(domain="arith", tables={}, thresholds=(0.5, 0.8), pipelined_staleness=4),
    "heavy-tail": Scenario(
        domain="calc",
        tables=HEAVY_TAIL_TABLES,
        # The warm start's mean reward is ~0.55 (success 0.44 held out); RL takes it past 0.85.
        thresholds=(0.7, 0.8),
        warm_start=True,
        pipelined_staleness=4,
    ),
    # Issue 29's bars: 1.5x sooner to 0.8 on arith, 2.5x on heavy-tailed calc.
    "arith-gpu": Scenario(
        domain="arith",
        tables={},
        thresholds=(0.5, 0.8),
        recipe="libs/domains/arith/gpu.toml",
        goal_speedup=1.5,
    ),
    "calc-gpu": Scenario(
        domain="calc",
        tables=HEAVY_TAIL_TABLES,
        # As heavy-tail: 0.8 is past the warm start (~0.55) and short of what RL reaches (0.85+).
        thresholds=(0.7, 0.8),
        warm_start=True,
        recipe="libs/domains/calc/gpu.toml",
        goal_speedup=2.5,
    ),
}
CPU_SCENARIOS = ("arith", "heavy-tail")


@dataclass(frozen=True)
class BenchOptions:
    """What the command line sets for every scenario of a run."""

    budget_s: float
    modes: tuple[str, ...] = ("sync", "async")
    tables: dict[str, Any] | None = None  # --device and --set, for both modes
    max_staleness: int | None = None
    policy_path: str | None = None
    rollout_workers: int = 1


def command_tables(device: str | None, overrides: list[str]) -> dict[str, Any]:
    """--device and --set as recipe tables: `--set rollout-worker.engine.type=paged` ->
    {"rollout_worker": {"engine": {"type": "paged"}}}, values read as TOML when they parse."""
    tables: dict[str, Any] = {}
    if device:
        policy = {"policy": {"device": device}}
        tables = {"trainer": policy, "rollout_worker": policy}
        tables["weight_broadcaster"] = {"diff_device": device}
    sets = merge_overrides(overrides)
    return merge_tables(tables, {k.replace("-", "_"): _typed(v) for k, v in sets.items()})


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value  # a JSON list or object, decoded by merge_overrides
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value  # a bare word (cpu, paged) stays text


def mode_tables(scenario: Scenario, mode: str, max_staleness: int | None) -> dict[str, Any]:
    """The tables that make `mode`: the pipelined bound from the flag, else the scenario's."""
    staleness = max_staleness if max_staleness is not None else scenario.pipelined_staleness
    if mode == "async" and staleness is not None:
        return merge_tables(MODES[mode], {"trainer": {"max_staleness": staleness}})
    return MODES[mode]


def scenario_options(
    scenario: Scenario, mode: str, run_dir: Path, options: BenchOptions
) -> LaunchOptions:
    """The launch of one mode; `options.policy_path` (a model folder) replaces the warm start."""
    recipe = load_recipe(scenario.recipe_path())
    warm = recipe.warm_start if scenario.warm_start else None
    policy: dict[str, Any] = {}
    if options.policy_path:
        policy = {
            s: {"policy": {"path": options.policy_path}} for s in ("trainer", "rollout_worker")
        }
    return LaunchOptions(
        run_dir=run_dir,
        duration_s=options.budget_s,
        recipe=merge_tables(
            recipe.tables,
            warm.rl if warm else {},
            scenario.tables,
            options.tables or {},
            mode_tables(scenario, mode, options.max_staleness),
            policy,
        ),
        warm_start=WarmStart(scenario.domain, warm) if warm and not options.policy_path else None,
        warm_start_root=default_cache_root(),
        rollout_workers=options.rollout_workers,
    )


def prepare_warm_start(scenario: Scenario, device: str) -> dict[str, Any] | None:
    """Build the scenario's warm start before either mode's clock starts; how long it took.

    On `cpu` (the default) it is built as calc's CPU recipe builds it, fp32, in a process
    that sees no GPU, on up to 8 cores; on `cuda` in this process, where the SFT's policy
    goes to the card (its `auto` device; the forward in bf16): faster, but another warm
    start."""
    recipe = load_recipe(scenario.recipe_path()).warm_start
    assert recipe is not None, f"{scenario.recipe_path()} has no [warm_start]"
    started = time.monotonic()
    if device == "cuda":
        ensure_warm_start(scenario.domain, default_cache_root(), recipe, emit=_print_line)
    else:
        cores = str(min(8, os.cpu_count() or 1))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": cores}
        build = [sys.executable, __file__, "--build-warm-start", str(scenario.recipe_path())]
        subprocess.run(build, env=env, check=True)
    return {"device": device, "ready_after_s": round(time.monotonic() - started, 1)}


def _print_line(event: str, **fields: Any) -> None:
    print(event, json.dumps(fields, default=str), flush=True)


def build_warm_start(recipe_path: Path) -> None:
    """The warm start of the recipe at `recipe_path`, in the cache (built when missing)."""
    recipe = load_recipe(recipe_path)
    assert recipe.warm_start is not None and recipe.env is not None
    path = ensure_warm_start(recipe.env, default_cache_root(), recipe.warm_start, _print_line)
    print(f"warm start: {path}", flush=True)


def run_mode(scenario: Scenario, mode: str, root: Path, options: BenchOptions) -> dict[str, Any]:
    run_dir = root / mode
    started = time.time()
    code = run_local(scenario_options(scenario, mode, run_dir, options))
    steps_path = run_dir / "trainer" / "steps.jsonl"
    records = (
        [json.loads(line) for line in steps_path.read_text().splitlines() if line.strip()]
        if steps_path.exists()
        else []
    )
    result = summarize(
        mode, code, started, records, options.budget_s, scenario.thresholds, scenario.threshold
    )
    return {**result, "version_latency": version_latency(run_dir)}


def version_latency(run_dir: Path) -> dict[str, Any]:
    """Optimizer step end -> swapped in the worker, over the run's versions (seconds), read
    as bench/version_latency.py reads its total, whichever way the versions travelled (a
    worker that takes them from the trainer's memory logs no fetch); the parts' medians
    where the delta path logged them."""
    ends = step_ends(run_dir)
    swapped = log_events(run_dir / "logs" / "rollout-worker.log", "weights swapped")
    totals = sorted(timestamp(swapped[v]) - ends[v] for v in set(ends) & set(swapped))
    if not totals:
        return {"versions": 0}
    found: dict[str, Any] = {
        "versions": len(totals),
        "median_s": round(statistics.median(totals), 4),
        "p90_s": round(totals[min(len(totals) - 1, int(0.9 * len(totals)))], 4),
    }
    parts = latency_summary(version_rows(run_dir))
    if parts["versions"]:
        found["parts_median_s"] = {p: parts[p]["median_s"] for p in PARTS if p != "total"}
    return found


def run_scenario(
    name: str, options: BenchOptions, before: dict[str, Any] | None, warm_device: str
) -> dict[str, Any]:
    """The modes asked for of one scenario (with those of `before`, its earlier entry, that
    this run does not repeat), their ratios, printed as a table."""
    scenario = SCENARIOS[name]
    warm = None
    if scenario.warm_start and not options.policy_path:
        warm = prepare_warm_start(scenario, warm_device)
    with tempfile.TemporaryDirectory(prefix=f"rlpipe-pipeline-{name}-") as root:
        fresh = {mode: run_mode(scenario, mode, Path(root), options) for mode in options.modes}
    results = {**((before or {}).get("modes") or {}), **fresh}
    outcome: dict[str, Any] = {
        "budget_s": {mode: results[mode]["budget_s"] for mode in results},
        "policy_path": options.policy_path,
        "rollout_workers": options.rollout_workers,
        "recipe": {
            "file": str(scenario.recipe_path().relative_to(REPO)),
            "over_it": merge_tables(scenario.tables, options.tables or {}),
            "pipelined_max_staleness": _pipelined_bound(scenario, options),
        },
        "warm_start": warm or (before or {}).get("warm_start"),
        "modes": {mode: results[mode] for mode in ("sync", "async") if mode in results},
    }
    if "sync" in results and "async" in results:
        outcome["ratios"] = ratios(results["sync"], results["async"], scenario.goal_speedup)
    print_scenario(name, outcome)
    return outcome


def _pipelined_bound(scenario: Scenario, options: BenchOptions) -> int | str:
    bound = mode_tables(scenario, "async", options.max_staleness).get("trainer", {})
    return bound.get("max_staleness", "the trainer's")


def print_scenario(name: str, outcome: dict[str, Any]) -> None:
    """One line per mode, then the ratios."""
    modes = outcome["modes"]
    # An entry of an older run (--modes joins it) may lack the fields this one adds.
    threshold = next(iter(modes.values())).get("threshold") if modes else None
    budgets = ", ".join(f"{mode} {s:.0f} s" for mode, s in outcome["budget_s"].items())
    print(f"scenario {name} ({budgets})")
    print(
        f"{'mode':6} {'steps':>6} {'samples/s':>10} {'busy':>6} {'dropped':>8} {'stale':>6} "
        f"{'v.lat s':>8} {'last10':>7} {f't->{threshold} s':>9} {'steps->':>8}"
    )
    for mode, r in modes.items():
        busy = f"{r['trainer_busy_fraction']:.2f}" if r["trainer_busy_fraction"] else "-"
        print(
            f"{mode:6} {r['steps']:>6} {r['samples_per_s']:>10} {busy:>6} "
            f"{r.get('dropped_fraction')!s:>8} {r.get('mean_staleness')!s:>6} "
            f"{r.get('version_latency', {}).get('median_s')!s:>8} {r['reward_last_10']!s:>7} "
            f"{r.get('time_to_threshold_s')!s:>9} {r.get('steps_to_threshold')!s:>8}"
        )
    if "ratios" in outcome:
        print(f"pipeline ratios: {json.dumps(outcome['ratios'])}")


def upgraded(document: dict[str, Any]) -> dict[str, Any]:
    """A results document in the per-scenario layout (older ones held arith's modes only)."""
    if "scenarios" in document or "modes" not in document:
        return document
    arith = {key: document.pop(key) for key in ("budget_s", "modes", "ratios") if key in document}
    return {**document, "scenarios": {"arith": arith}}


def cuda_card(device: str | None) -> str | None:
    """The CUDA card's name when the run may use one (--device other than cpu), else None."""
    if device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall clock per mode")
    parser.add_argument("--out", type=Path, default=None, help="default: the machine's file")
    parser.add_argument(
        "--scenarios",
        default=",".join(CPU_SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--modes", default="sync,async", help="sync, async or both")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="for the trainer and workers (and the deltas' diff); default: each recipe's",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="the pipelined mode's bound (default: the scenario's, else the trainer's own)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SERVICE.FIELD=VALUE",
        help="a setting for both modes, over the scenario's recipe (repeatable)",
    )
    parser.add_argument(
        "--warm-start-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where a missing warm start is built (default cpu: as calc's CPU recipe does)",
    )
    parser.add_argument(
        "--policy-path",
        default=None,
        help="model folder for the tool scenarios instead of the cached warm start",
    )
    parser.add_argument(
        "--rollout-workers",
        type=int,
        default=1,
        metavar="N",
        help="rollout-worker processes in both modes (rlpipe demo --rollout-workers)",
    )
    parser.add_argument("--build-warm-start", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.build_warm_start:  # prepare_warm_start's process without a GPU
        build_warm_start(args.build_warm_start)
        return 0
    names = [name for name in args.scenarios.split(",") if name]
    modes = tuple(m for m in ("sync", "async") if m in args.modes.split(","))
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not modes:
        sys.exit(f"unknown scenarios {unknown} (of {', '.join(SCENARIOS)}) or no mode")
    options = BenchOptions(
        budget_s=args.budget_s,
        modes=modes,
        tables=command_tables(args.device, args.overrides),
        max_staleness=args.max_staleness,
        policy_path=args.policy_path,
        rollout_workers=args.rollout_workers,
    )
    out = args.out or result_file("pipeline", cuda_card(args.device))
    document: dict[str, Any] = {}
    if out.exists():  # keep the scenarios (and modes) this run does not repeat
        document = upgraded(json.loads(out.read_text()))
    scenarios = document.setdefault("scenarios", {})
    for name in names:
        before = scenarios.get(name) if len(modes) == 1 else None
        scenarios[name] = run_scenario(name, options, before, args.warm_start_device)
    document.update(
        benchmark="pipeline",
        machine=machine_description(args.device),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(document))
    print(f"wrote {out}")
    codes = [scenarios[name]["modes"][mode]["exit_code"] for name in names for mode in modes]
    return 0 if all(code == 0 for code in codes) else 1


def machine_description(device: str | None) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "card": cuda_card(device),
    }


if __name__ == "__main__":
    sys.exit(main())
