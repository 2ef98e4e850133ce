"""Trainer ranks against one rank: tokens/s of the trainer's own learners on the same batches.

    python bench/trainer_ranks_bench.py --preset byte-0.5b                       # 1 rank
    torchrun --standalone --nproc-per-node 2 bench/trainer_ranks_bench.py --preset byte-0.5b
    torchrun --standalone --nproc-per-node 2 bench/trainer_ranks_bench.py --preset tiny \
        --device cpu --steps 3 --warmup 1 --out /tmp/ranks.json                  # gloo, a smoke run

One rank is the 1-rank trainer's learner (libs.trainer.learner.LocalLearner); N ranks under
torchrun are the sharded trainer's (libs.trainer.ranks: RankLearner on rank 0, `follow` on
the others; --layout: replicas or FSDP2 shards, auto by size as the trainer chooses), so what
is timed is the code the trainer service runs. Each step is the
learner's `train` on a batch of --groups x --group-size samples (prompts of
--prompt-tokens, completions of --completion-tokens: the digit task's 2 by default, as
bench/gpu_loop.sh trains; rewards varied within each group), then, every --publish-every
steps, `published_state()`: the version the trainer stages (on N ranks a gather of every
shard to rank 0). After --warmup steps, --steps are timed: tokens/s counts every token of
the batch (prompt and completion) per second of step plus publish.

Writes bench/results/<card>/trainer_ranks.json (or --out): one entry per world size, the
others kept, and each one's ratio to the 1-rank entry of the same settings when present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from result_file import git_commit, result_file, result_json

from libs.policy import PolicyConfig
from libs.tokenizer import ByteTokenizer
from libs.trainer.config import TrainerConfig
from libs.trainer.learner import Learner, LocalLearner
from libs.trainer.lineage import Lineage
from libs.trainer.ranks import RankLearner, follow, this_rank, world_size
from proto.messages import Rollout, ScoredRollout, Task, Turn

TOKENIZER = ByteTokenizer()
# What makes two entries comparable: the same model and the same batches.
SETTINGS = ("preset", "groups", "group_size", "prompt_tokens", "completion_tokens",
            "publish_every", "steps")  # fmt: skip


def samples(step: int, args: argparse.Namespace) -> list[ScoredRollout]:
    """A batch of `groups` groups whose completions' rewards differ within each group."""
    out = []
    for group in range(args.groups):
        task_id = f"s{step}g{group}"
        task = Task(task_id=task_id, env="arith", prompt="", group_size=args.group_size)
        for index in range(args.group_size):
            prompt = [(7 * group + i) % 200 + 1 for i in range(args.prompt_tokens)]
            completion = [(3 * index + i) % 200 + 1 for i in range(args.completion_tokens - 1)]
            turns = [
                Turn(role="user", token_ids=prompt),
                Turn(
                    role="assistant",
                    token_ids=[*completion, TOKENIZER.eos_id],
                    logprobs=[-1.0] * args.completion_tokens,
                    policy_version=step,
                ),
            ]
            rollout = Rollout(
                rollout_id=f"{task_id}.{index}", task_id=task_id, group_id=task_id,
                sample_index=index, env="arith", turns=turns, finish_reason="stop", task=task,
            )  # fmt: skip
            out.append(ScoredRollout(rollout=rollout, reward=float(index % 3) / 2))
    return out


def learner(args: argparse.Namespace) -> Learner:
    # The exact-version mismatch meter is off: N ranks refuse it, and with this staleness bound
    # the 1-rank learner would keep a new pinned copy of the weights every step.
    config = TrainerConfig(
        batch_groups=args.groups,
        max_staleness=1000,
        mismatch_exact_every_steps=0,
        rank_layout=args.layout,
    )
    policy = PolicyConfig(preset=args.preset, device=args.device)
    if world_size() > 1:
        return RankLearner(config, policy, TOKENIZER)
    return LocalLearner(config, policy, TOKENIZER)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0: the steps, timed after the warmup."""
    trainer, lineage = learner(args), Lineage()
    step_s, publish_s = [], []
    for step in range(args.warmup + args.steps):
        batch = samples(step, args)
        started = time.perf_counter()
        trainer.train(batch, step, lineage, 1000)
        synchronize(args.device)
        trained = time.perf_counter()
        if (step + 1) % args.publish_every == 0:
            trainer.published_state()
            synchronize(args.device)
        if step >= args.warmup:
            step_s.append(trained - started)
            publish_s.append(time.perf_counter() - trained)
    trainer.close()
    tokens = args.groups * args.group_size * (args.prompt_tokens + args.completion_tokens)
    seconds = sum(step_s) + sum(publish_s)
    return {
        "world_size": world_size(),
        "layout": args.layout if world_size() > 1 else "1 rank",
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens * len(step_s) / seconds, 1),
        "step_s_median": round(statistics.median(step_s), 4),
        "publish_s_median": round(statistics.median(publish_s), 4),
        "steps": len(step_s),
    }


def write(args: argparse.Namespace, found: dict[str, Any]) -> Path:
    """Add this world size's entry to the result file, with its ratio to 1 rank."""
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out = args.out or result_file("trainer_ranks", card)
    document = json.loads(out.read_text()) if out.exists() else {}
    settings = {name: getattr(args, name) for name in SETTINGS}
    if document.get("settings") != settings:  # another batch: the old entries do not compare
        document = {"settings": settings, "ranks": {}}
    document.update(card=card, cpu_count=os.cpu_count(), git_commit=git_commit())
    document["ranks"][str(found["world_size"])] = found
    one = document["ranks"].get("1")
    for entry in document["ranks"].values():
        entry["tokens_per_s_vs_1_rank"] = (
            round(entry["tokens_per_s"] / one["tokens_per_s"], 3) if one else None
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(document))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="byte-0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--completion-tokens", type=int, default=2)
    parser.add_argument("--publish-every", type=int, default=1, help="steps per version")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layout", default="auto", choices=["auto", "replicate", "shard"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if world_size() > 1 and this_rank() > 0:
        follow(PolicyConfig(preset=args.preset, device=args.device), "warning", "json")
        return
    found = measure(args)
    out = write(args, found)
    print(json.dumps(found), f"\nwrote {out}")


if __name__ == "__main__":
    main()
