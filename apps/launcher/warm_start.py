"""The warm start of a recipe with a `[warm_start]` table: demonstrations, then SFT, cached.

The embedded random-init policy never writes a tool call, so RL on a tool domain has nothing
to reinforce. The demo therefore starts from a policy fine-tuned on a scripted expert's
demonstrations (the domain's expert, recorded through its real environment) by the SFT stage
(libs.sft), the way a user starts from their own pretrained base:

    recipe = load_recipe(domain("calc").recipe_path).warm_start
    path = ensure_warm_start("calc", cache_root, recipe)    # built once (minutes), then reused

The folder `<cache_root>/<env>-<fingerprint>/` holds `demos.jsonl`, the tokenizer trained on
them (libs.sft.tokenizer), and the model folder, which carries that tokenizer; the
fingerprint covers the recipe's build settings (demonstrations and SFT: apps.launcher.recipe)
and what the demonstrations are (a rendered sample: a changed expert, environment or template
changes it), so changing either builds a new one. An interrupted build resumes (the SFT
checkpoint). The SFT runs on the GPU when there is one (the recipe's `preset = "agent-75m"`
is for one), else on two torch threads where there are two cores, unless OMP_NUM_THREADS
says otherwise (warm_start_threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from apps.launcher.recipe import WarmStartRecipe
from apps.sft_cli import LogFn, run_with_progress
from libs.experts.demos import (
    DemoConfig,
    demonstrations_digest,
    expert_domains,
    write_demonstrations,
)
from libs.policy import PolicyConfig
from libs.sft.tokenizer import ensure_transcript_tokenizer
from libs.sft.train import SftConfig, finished_result

DEMOS_FILE = "demos.jsonl"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
# A checkpoint of agent-75m (0.9 GB with AdamW's moments, written durably) took 1.3 s on an
# H200 machine, the time of 25 SFT steps there: every 50 steps cost a third of the SFT.
CHECKPOINT_EVERY_STEPS = 200


def demo_config(env: str, recipe: WarmStartRecipe) -> DemoConfig:
    """The demonstrations `recipe` records for domain `env`."""
    return DemoConfig(env=env, num_tasks=recipe.num_tasks, error_rate=recipe.error_rate)


def fingerprint(env: str, recipe: WarmStartRecipe) -> str:
    """A digest of the recipe's build settings and of what its demonstrations are (a sample
    of them rendered: libs.experts.demos.demonstrations_digest)."""
    demos = demo_config(env, recipe)
    fields: dict[str, Any] = {"demos": asdict(demos), **recipe.build_settings()}
    for name in ("num_tasks", "error_rate"):  # in `demos`
        fields.pop(name)
    fields["demonstrations"] = demonstrations_digest(demos)
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    """`$RLPIPE_CACHE_DIR/warm_start`, else `~/.cache/rlpipe/warm_start`."""
    base = os.environ.get("RLPIPE_CACHE_DIR") or Path.home() / ".cache" / "rlpipe"
    return Path(base) / "warm_start"


def warm_start_dir(env: str, cache_root: Path, recipe: WarmStartRecipe) -> Path:
    return cache_root / f"{env}-{fingerprint(env, recipe)}"


def sft_stage(env: str, cache_root: Path, recipe: WarmStartRecipe) -> SftConfig:
    """The SFT run of `env`'s warm start: the recipe's random-init policy preset over its
    tokenizer, on its demonstrations (on the GPU when there is one: libs.sft.train)."""
    folder = warm_start_dir(env, cache_root, recipe)
    return SftConfig(
        data=folder / DEMOS_FILE,
        out=folder / MODEL_DIR,
        policy=PolicyConfig(preset=recipe.preset, tokenizer=str(folder / TOKENIZER_DIR)),
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        checkpoint_every_steps=CHECKPOINT_EVERY_STEPS,
    )


def ensure_warm_start(
    env: str, cache_root: Path, recipe: WarmStartRecipe, emit: LogFn | None = None
) -> Path:
    """The model folder of `env`'s warm start, built first when missing (with progress: a
    bar on a terminal, else lines through `emit`)."""
    if env not in expert_domains():
        raise ValueError(
            f"no warm start for env {env!r}: it has no scripted expert (domains with one: "
            f"{', '.join(expert_domains())}); remove the recipe's [warm_start] table"
        )
    sft = sft_stage(env, cache_root, recipe)
    if finished_result(sft) is not None:
        return sft.out
    with torch_threads(warm_start_threads()):
        _ensure_demos(sft.data, demo_config(env, recipe))
        tokenizer = sft.data.parent / TOKENIZER_DIR
        ensure_transcript_tokenizer(sft.data, tokenizer, recipe.tokenizer_vocab_size)
        run_with_progress(sft, f"warm start ({env}): sft", emit)
    return sft.out


def warm_start_threads() -> int:
    """Math threads of the warm start's SFT: OMP_NUM_THREADS when set, else two when the
    machine has them. Nothing else runs while the demo builds its warm start (the services
    start after), so the second core is free; under load from other processes one thread is
    better, which is what OMP_NUM_THREADS=1 says."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, min(2, len(os.sched_getaffinity(0))))


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ensure_demos(path: Path, demos: DemoConfig) -> None:
    if not path.exists():
        partial = path.with_suffix(".partial")
        asyncio.run(write_demonstrations(demos, partial))
        partial.rename(path)


def policy_tables(policy_path: Path) -> dict[str, Any]:
    """The recipe tables that make the trainer and the workers start from the policy folder
    at `policy_path` (the workers' harness in its tokens: apps.launcher.harness)."""
    policy = {"policy": {"path": str(policy_path)}}
    return {"trainer": policy, "rollout_worker": policy}
