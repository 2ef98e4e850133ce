"""An agent domain trained as a user would: warm start, held-out figures, RL, held-out again.

    python bench/agent_bench.py --recipe libs/domains/functions/gpu.toml --rl-s 280   # one GPU
    .venv/bin/python bench/agent_bench.py --recipe libs/domains/calc/recipe.toml --rl-s 60 \
        --eval-tasks 8 --device cpu --engine hf --out /tmp/agent.json                 # a smoke run

1. warm start: the recipe's `[warm_start]` (the expert's demonstrations through the real
   environment, a tokenizer trained on them, the SFT of its `preset`) in the warm-start cache
   ($RLPIPE_CACHE_DIR/warm_start): its seconds when built here, `cached` when it was there;
2. held-out: `--eval-tasks` episodes of the domain's evaluation tasks (`rlpipe domain
   evaluate`, a child process: seed 777, never the feeder's, the demonstrations' nor the eval
   gate's) with the warm start, on `--device` and `--engine`;
3. RL: `rlpipe demo --recipe FILE --duration-s N` from the warm start (a child process, its
   run folder kept under --run-root when given), the trainer's figures from its step records
   (steps, reward and success of the first and last 10, busy, staleness, dropped,
   zero-variance groups), the run's episode figures, and the eval gate's held-out episodes
   of a few tasks at its first and last evaluated versions, as text;
4. held-out again, with the run's last checkpoint.

`--set SERVICE.FIELD=VALUE` passes through to the demo (e.g. `rollout-worker.engine.type=hf`
for the hf loop on the same recipe). Sandboxed domains need bubblewrap on PATH.
Writes bench/results/<card>/agent_<env>.json (or --out) and prints the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
from result_file import git_commit, result_file, result_json

from apps.launcher.recipe import load_recipe
from apps.launcher.warm_start import (
    MODEL_DIR,
    default_cache_root,
    ensure_warm_start,
    warm_start_dir,
)
from apps.report.figures import mean, run_figures, success_of
from apps.report.transcripts import before_after
from libs.sft.train import RESULT_FILE
from libs.trainer.metrics import read_transcripts

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "apps.cli"]
# Held-out tasks whose episodes before and after RL the result shows.
TRANSCRIPTS = 2
# Fields of the run's summary.json kept in the result (the trainer's figures come from its
# step records: its last health answer can be one given while it stops).
RUN_FIELDS = (
    "duration_s", "episodes_first_steps", "episodes_last_steps", "all_services_seen_healthy",
)  # fmt: skip


def held_out(policy: Path, env: str, args: argparse.Namespace) -> dict[str, Any]:
    """`rlpipe domain evaluate` of `policy` on `env`'s held-out tasks, in a child process
    (the GPU memory of its engine goes back when it exits)."""
    command = [
        *CLI, "domain", "evaluate", "--policy-path", str(policy), "--env", env,
        "--num-tasks", str(args.eval_tasks), "--device", args.device, "--engine", args.engine,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"evaluate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {**figures, "seconds": round(time.perf_counter() - started, 1)}


def warm_start(recipe_path: Path) -> tuple[Path, dict[str, Any]]:
    """The recipe's warm start, built as `rlpipe demo` builds it when missing."""
    recipe = load_recipe(recipe_path)
    if recipe.warm_start is None or recipe.env is None:
        raise SystemExit(f"{recipe_path} has no [warm_start] (or no env_gateway.env)")
    folder = warm_start_dir(recipe.env, default_cache_root(), recipe.warm_start)
    cached = (folder / MODEL_DIR / RESULT_FILE).is_file()
    started = time.perf_counter()
    model = ensure_warm_start(recipe.env, default_cache_root(), recipe.warm_start)
    if torch.cuda.is_available():  # the SFT's cached blocks, for the child processes
        torch.cuda.empty_cache()
    sft = json.loads((model / RESULT_FILE).read_text())
    info = {
        "cached": cached,
        "seconds": None if cached else round(time.perf_counter() - started, 1),
        "preset": recipe.warm_start.preset,
        "demonstrations": recipe.warm_start.num_tasks,
        "sft_steps": sft["steps"],
        "sft_final_loss": sft["final_loss"],
        "sft_train_s": sft.get("train_s"),
    }
    return model, info


def reinforce(recipe_path: Path, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """`rlpipe demo` for --rl-s seconds from the warm start; the run's summary."""
    sets = [part for value in args.set for part in ("--set", value)]
    command = [
        *CLI, "demo", "--recipe", str(recipe_path), "--duration-s", str(args.rl_s),
        "--run-dir", str(run_dir), *sets,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, check=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    if done.returncode != 0:
        raise SystemExit(f"the RL run failed ({done.returncode}): {run_dir}/logs")
    return {
        **{field: summary.get(field) for field in RUN_FIELDS},
        **training(run_dir),
        "held_out_transcripts": transcripts(run_dir),
    }


def training(run_dir: Path) -> dict[str, Any]:
    """The trainer's figures from its step records (apps.report.figures, as `rlpipe report`)."""
    figures = run_figures(run_dir)
    if figures is None or not figures.steps:
        return {"trainer_steps": 0}
    steps = figures.steps
    return {
        "trainer_steps": len(steps),
        "trainer_busy_fraction": round(steps[-1].busy_fraction, 3),
        "trainer_samples_per_s": round(figures.samples_per_s or 0.0, 2),
        "trainer_staleness": round(figures.staleness, 2),
        "trainer_dropped_fraction": round(figures.dropped_fraction, 3),
        "trainer_reward_first_10": rounded(mean([s.mean_reward for s in figures.first])),
        "trainer_reward_last_10": rounded(mean([s.mean_reward for s in figures.last])),
        "trainer_success_first_10": rounded(success_of(figures.first)),
        "trainer_success_last_10": rounded(success_of(figures.last)),
        "trainer_zero_variance_groups": rounded(
            mean([s.num_zero_variance_groups / max(s.num_groups, 1) for s in steps])
        ),
    }


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def transcripts(run_dir: Path) -> list[dict[str, Any]]:
    """The eval gate's first TRANSCRIPTS held-out tasks at its first and last evaluated
    versions (what `rlpipe report` writes to transcripts.md): the learned behaviour."""
    return [
        {
            "task_id": before.episode.task_id,
            "before": msgspec.to_builtins(before),
            "after": msgspec.to_builtins(after) if after else None,
        }
        for before, after in before_after(read_transcripts(run_dir))[:TRANSCRIPTS]
    ]


@contextlib.contextmanager
def run_root(parent: Path | None) -> Iterator[Path]:
    """A new folder for the RL run: under `parent`, kept (its steps, checkpoints and logs for
    `rlpipe report`); else temporary."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix="rlpipe-agent-bench-", dir=parent))
        return
    with tempfile.TemporaryDirectory(prefix="rlpipe-agent-bench-") as root:
        yield Path(root)


def last_checkpoint(run_dir: Path) -> Path:
    found = sorted((run_dir / "trainer" / "checkpoints").glob("step-*"))
    if not found:
        raise SystemExit(f"the run wrote no checkpoint: {run_dir}/trainer/checkpoints")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--rl-s", type=float, default=280.0, help="seconds of RL")
    parser.add_argument("--eval-tasks", type=int, default=128, help="held-out episodes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--engine", default="paged", choices=("hf", "paged"))
    parser.add_argument("--set", action="append", default=[], metavar="SERVICE.FIELD=VALUE")
    parser.add_argument(
        "--run-root", type=Path, default=None,
        help="where the run folder is made and kept (default: a temporary folder, removed)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    env = str(recipe.env)
    policy, warm = warm_start(args.recipe)
    before = held_out(policy, env, args)
    print(f"warm start {json.dumps(warm)}\nheld-out before: {json.dumps(before)}", flush=True)
    with run_root(args.run_root) as root:
        run = reinforce(args.recipe, args, root / "run")
        after = held_out(last_checkpoint(root / "run"), env, args)
    print(f"RL: {json.dumps(run)}\nheld-out after: {json.dumps(after)}", flush=True)
    card = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    report = {
        "card": card, "cpu_count": os.cpu_count(), "git_commit": git_commit(),
        "command": " ".join(["python", "bench/agent_bench.py", *sys.argv[1:]]),
        "recipe": str(args.recipe), "env": env, "engine": args.engine, "rl_s": args.rl_s,
        "warm_start": warm, "held_out_before": before, "rl": run, "held_out_after": after,
        "success_gain": round(after["success"] - before["success"], 4),
    }  # fmt: skip
    out = args.out or result_file(f"agent_{env}", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(report))
    print(f"held-out success {before['success']} -> {after['success']}; wrote {out}")


if __name__ == "__main__":
    main()
