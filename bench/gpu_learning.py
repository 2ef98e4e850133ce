"""How fast a policy learns the demo task, per trainer setting, in one process (no services).

    python bench/gpu_learning.py --preset byte-0.5b --device cuda --steps 150 \
        --run lr=5e-4,master=policy --run lr=1e-4,master=fp32

Synchronous GRPO on the `arith` tasks the demo's feeder serves (difficulty 0, groups of 16,
16 groups per step), with the project's own parts: the engine from the engine factory, the
one evaluator (harness, batcher, rubric) against the environment in this process, the
trainer's `train_step` and learning-rate schedule, weights handed to the engine after every
step. Each `--run` is one trainer setting (`lr`, `master`: "fp32" keeps fp32 weights and
AdamW state and computes in the policy dtype, "policy" trains in the policy dtype itself,
`decay`: steps of the linear decay, `staleness` is not modelled here: every sample is on
policy). Per run: reward per step, seconds per step, and the fraction of the published
(policy-dtype) values each step changed, which is what the weight codec has to ship.

This is the search behind the trainer's defaults per model size (libs/trainer/config.py);
`bench/gpu_loop.sh` then checks them in the real pipelined loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import result_file, result_json

from libs.domains.registry import make_env
from libs.engine.factory import EngineConfig, build_engine
from libs.envs.local_client import LocalEnvClient
from libs.logs import configure_logging
from libs.policy import PolicyConfig, load_policy_tokenizer
from libs.rollout.agent import AgentSettings
from libs.rollout.evaluate import evaluate, mean_reward
from libs.trainer.config import TrainerConfig
from libs.trainer.precision import TrainingPrecision
from libs.trainer.schedule import learning_rate_at
from libs.trainer.step import train_step

GROUP_SIZE = 16
GROUPS_PER_STEP = 16


def parse_run(text: str) -> dict[str, str]:
    """`lr=1e-4,master=fp32` -> {"lr": "1e-4", "master": "fp32"}."""
    fields = dict(part.split("=", 1) for part in text.split(",") if part)
    unknown = set(fields) - {"lr", "master", "decay", "engine"}
    if unknown:
        raise SystemExit(f"unknown run field(s) {sorted(unknown)} in {text!r}")
    return fields


async def run_one(args: argparse.Namespace, run: dict[str, str]) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    policy = PolicyConfig(preset=args.preset, device=args.device)
    decay = run.get("decay", "400")
    config = TrainerConfig(
        policy=policy,
        learning_rate=float(run.get("lr", "5e-4")),
        learning_rate_decay_steps=None if decay == "none" else int(decay),
        master_weights=run.get("master", "fp32"),
    )
    precision = TrainingPrecision.for_policy(config.master_weights, policy)
    tokenizer = load_policy_tokenizer(policy)
    model = precision.build_model(policy)
    config = config.sized_for(sum(p.numel() for p in model.parameters()))
    engine = build_engine(EngineConfig(type=run.get("engine", "hf")), policy)
    engine.update_weights(precision.published_copy(model), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate_at(config, 0))
    environment = make_env("arith")
    source = environment.task_source(difficulty=0, group_size=GROUP_SIZE, seed=args.seed)
    client = LocalEnvClient({"arith": environment})
    previous = precision.published_copy(model)
    rows = []
    started = time.perf_counter()
    for step in range(args.steps):
        tasks = [source.task(step * GROUPS_PER_STEP + i) for i in range(GROUPS_PER_STEP)]
        t0 = time.perf_counter()
        scored = await evaluate(engine, tokenizer, tasks, client, AgentSettings(), temperature=1.0)
        t1 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(config, step)
        with precision.compute():
            stats = train_step(model, optimizer, scored, step, config, tokenizer.pad_id)
        published = precision.published_copy(model)
        changed = sum(int((published[k] != previous[k]).sum()) for k in published)
        total = sum(v.numel() for v in published.values())
        previous = published
        engine.update_weights(published, step + 1)
        t2 = time.perf_counter()
        rows.append(
            {
                "step": step + 1,
                "reward": round(mean_reward(scored), 4),
                "generate_s": round(t1 - t0, 3),
                "train_s": round(t2 - t1, 3),
                "changed_fraction": round(changed / total, 5),
                "grad_norm": round(stats.grad_norm, 4),
                "mismatch_mean_abs": round(stats.mismatch.mean_abs_diff, 5),
                "zero_variance_groups": stats.num_zero_variance_groups,
            }
        )
        if (step + 1) % 10 == 0:
            last = rows[-10:]
            print(
                f"  {run} step {step + 1}: reward(last10) "
                f"{sum(r['reward'] for r in last) / 10:.3f}, changed "
                f"{sum(r['changed_fraction'] for r in last) / 10:.4f}, "
                f"{time.perf_counter() - started:.0f}s",
                flush=True,
            )
        if time.perf_counter() - started > args.max_seconds_per_run:
            break
    del engine, model, optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"run": run, "steps": rows, "seconds": round(time.perf_counter() - started, 1)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]

    def window(rows: list[dict[str, Any]], key: str) -> float:
        return round(sum(r[key] for r in rows) / max(len(rows), 1), 4)

    reached = next((r["step"] for r in steps if r["reward"] >= 0.8), None)
    return {
        "run": result["run"],
        "steps": len(steps),
        "reward_first10": window(steps[:10], "reward"),
        "reward_last10": window(steps[-10:], "reward"),
        "first_step_reward_ge_0.8": reached,
        "changed_fraction_median": sorted(r["changed_fraction"] for r in steps)[len(steps) // 2],
        "step_s": round(result["seconds"] / max(len(steps), 1), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="byte-0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-seconds-per-run", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", action="append", default=[], help="lr=..,master=..,decay=..")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    configure_logging("gpu-learning", level="warning")
    runs = [parse_run(text) for text in args.run] or [{}]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {card}", flush=True)
    results = []
    for run in runs:
        result = asyncio.run(run_one(args, run))
        results.append(result)
        print(json.dumps(summarize(result)), flush=True)
    report = {
        "card": card,
        "preset": args.preset,
        "summary": [summarize(r) for r in results],
        "runs": results,
    }
    out = Path(args.out) if args.out else result_file("learning", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
