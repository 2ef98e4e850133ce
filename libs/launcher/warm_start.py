"""The warm start of `rlpipe demo --env calc|recall`: demonstrations, then SFT, cached.

The embedded random-init policy never writes a tool call, so RL on a tool environment has
nothing to reinforce. The demo therefore starts from a policy fine-tuned on a scripted
expert's demonstrations (libs.experts, recorded through the real environment) by the SFT
stage (libs.sft), the way a user starts from their own pretrained base:

    path = ensure_warm_start("calc", cache_root)    # built once (minutes), then reused

The folder `<cache_root>/<env>-<fingerprint>/` holds `demos.jsonl`, the tokenizer trained on
them where the recipe has one (calc's: libs.sft.tokenizer), and the model folder, which
carries that tokenizer; the fingerprint covers the recipe (demonstration and SFT settings)
and what the demonstrations are (a rendered sample: a changed expert, environment or template
changes it), so changing either builds a new one. An interrupted build resumes (the SFT
checkpoint). The SFT runs on two torch threads where there are two cores, unless
OMP_NUM_THREADS says otherwise (warm_start_threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from libs.experts.demos import (
    EXPERTS,
    DemoConfig,
    demonstrations_digest,
    harness_settings,
    write_demonstrations,
)
from libs.policy import PolicyConfig
from libs.sft.cli import LogFn, run_with_progress
from libs.sft.tokenizer import ensure_transcript_tokenizer
from libs.sft.train import SftConfig, finished_result

DEMOS_FILE = "demos.jsonl"
# RL from a warm start takes small steps, anchored to it. At the trainer's default 5e-4
# without an anchor, Adam's normalized updates on 16-episode batches undid a calc warm start
# in 8 steps (reward 0.70 -> 0.20, the policy stopped calling tools); at 3e-4 even with a KL
# penalty of 0.2 to the warm start (libs.trainer.reference) it drifted off. From calc's
# warm start, in-process GRPO on 2 groups of 8 a step at 1e-4 with the anchor at 0.2 raised
# success 0.38 -> 0.64 -> 0.81 on 96 held-out tasks at steps 0/20/40 (2e-4 without anchor:
# 0.50 -> 0.68 -> 0.75). Groups of 8 give GRPO more contrast.
RL_LEARNING_RATE = "1e-4"
RL_KL_COEF = "0.2"
RL_GROUP_SIZE = "8"
MODEL_DIR = "model"
SHORT_STAGE_DIR = "short_stage"


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the warm start of one environment is made: demonstrations, then SFT, optionally in
    two stages: first on the transcripts without their long system message (where the tiny
    byte-level model learns to copy numbers from the conversation), then on the full ones."""

    demos: DemoConfig
    short_steps: int
    full_steps: int
    short_batch_size: int = 32
    full_batch_size: int = 16
    learning_rate: float = 3e-3
    full_learning_rate: float | None = None  # None: learning_rate / 3
    # Start from the short stage of another recipe in RECIPES instead of making one: the
    # skill it teaches (copying numbers from the conversation) carries over.
    short_stage_of: str | None = None
    # None: the embedded byte tokenizer. N: a BPE tokenizer of at most N tokens trained on the
    # demonstrations (libs.tokenizer.train_chat_tokenizer), which the model folder carries.
    tokenizer_vocab_size: int | None = None

    def fingerprint(self) -> str:
        """A digest of the recipe's settings and of what its demonstrations are (a sample of
        them rendered: libs.experts.demos.demonstrations_digest)."""
        fields = {key: value for key, value in asdict(self).items() if value is not None}
        fields["demonstrations"] = demonstrations_digest(self.demos)
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Tuned on a 2-core machine. calc's episodes are written in a BPE tokenizer of their own,
# trained on the demonstrations: 73 tokens an episode (20 generated) against 684 bytes, so an
# SFT step of 32 takes 0.14 s and the tiny model learns in one stage what the byte-level
# recipe needed two for, and learns it better: after 1,200 steps it copies the tool's result
# into its answer in 127 of 128 held-out tasks (400 steps: 72 of 128, the main failure; the
# byte-level recipe: greedy success 0.52 after 6.3 minutes). RL can only sharpen what the
# warm start already does right; the room it leaves comes from the expert's slips (an
# operand off by 1-3, or multiply for divide, in error_rate of the calls), which the policy
# imitates at temperature 1 and RL removes. Measured (128 held-out tasks, error_rate 0.3):
# greedy success 0.96, 0.64 at temperature 1, the failures being the imitated slips; then
# in-process GRPO (4 groups of 8 a step, lr 1e-4) 0.58 -> 0.88 -> 0.89 -> 0.92 on 96 tasks at
# steps 0/20/40/60.
RECIPES: dict[str, WarmStartRecipe] = {
    "calc": WarmStartRecipe(
        DemoConfig(env="calc", num_tasks=5000, error_rate=0.4),
        short_steps=0,
        full_steps=1200,
        full_batch_size=32,
        full_learning_rate=3e-3,
        tokenizer_vocab_size=1024,
    ),
    # The byte-level short stage recall starts from: short transcripts of calc, where the tiny
    # model learns to copy numbers (loss ~0.18 is a plateau of well-formed calls with made-up
    # numbers; 700 steps of 32 leave it).
    "calc-byte": WarmStartRecipe(
        DemoConfig(env="calc", num_tasks=5000, error_rate=0.3),
        short_steps=700,
        full_steps=100,
        short_batch_size=32,
    ),
    # Recall's short contexts are still ~600 tokens (its tool results): too slow to teach
    # copying on 2 cores, so it starts from calc's byte-level short stage and learns recall in
    # full. It stays on the byte tokenizer: its context budget and summaries are sized in
    # bytes (libs.envs.recall).
    "recall": WarmStartRecipe(
        DemoConfig(env="recall", num_tasks=2000, error_rate=0.02),
        short_steps=0,
        full_steps=150,
        full_batch_size=8,
        full_learning_rate=2e-3,
        short_stage_of="calc-byte",
    ),
}
TOKENIZER_DIR = "tokenizer"


def default_cache_root() -> Path:
    """`$RLPIPE_CACHE_DIR/warm_start`, else `~/.cache/rlpipe/warm_start`."""
    base = os.environ.get("RLPIPE_CACHE_DIR") or Path.home() / ".cache" / "rlpipe"
    return Path(base) / "warm_start"


def has_warm_start(env: str) -> bool:
    return env in RECIPES and env in EXPERTS


def warm_start_dir(env: str, cache_root: Path, recipe: WarmStartRecipe | None = None) -> Path:
    recipe = recipe or RECIPES[env]
    return cache_root / f"{env}-{recipe.fingerprint()}"


def short_stage(env: str, cache_root: Path, recipe: WarmStartRecipe) -> SftStage | None:
    """The short-context stage `env`'s full stage starts from (another recipe's when this one
    borrows it), or None when the recipe has none."""
    if recipe.short_stage_of:
        other = recipe.short_stage_of
        return short_stage(other, cache_root, RECIPES[other])
    if recipe.short_steps == 0:
        return None
    folder = warm_start_dir(env, cache_root, recipe)
    config = SftConfig(
        data=folder / DEMOS_FILE,
        out=folder / SHORT_STAGE_DIR,
        steps=recipe.short_steps,
        batch_size=recipe.short_batch_size,
        learning_rate=recipe.learning_rate,
        without_system_message=True,
    )
    return SftStage(config, env, recipe)


@dataclass(frozen=True)
class SftStage:
    """One SFT stage of a warm start and the recipe (of `env`) whose demonstrations it uses."""

    config: SftConfig
    env: str
    recipe: WarmStartRecipe


def full_stage(env: str, cache_root: Path, recipe: WarmStartRecipe) -> SftConfig:
    """The SFT config of the full-transcript stage: from the short stage's model when there is
    one, else from the random-init tiny policy (over the recipe's own tokenizer, if any)."""
    folder = warm_start_dir(env, cache_root, recipe)
    short = short_stage(env, cache_root, recipe)
    if short is not None:
        policy = PolicyConfig(path=str(short.config.out))
    elif recipe.tokenizer_vocab_size is not None:
        policy = PolicyConfig(tokenizer=str(folder / TOKENIZER_DIR))
    else:
        policy = PolicyConfig()
    return SftConfig(
        data=folder / DEMOS_FILE,
        out=folder / MODEL_DIR,
        policy=policy,
        steps=recipe.full_steps,
        batch_size=recipe.full_batch_size,
        learning_rate=recipe.full_learning_rate or recipe.learning_rate / 3,
    )


def ensure_warm_start(
    env: str,
    cache_root: Path,
    recipe: WarmStartRecipe | None = None,
    emit: LogFn | None = None,
) -> Path:
    """The model folder of `env`'s warm start, built first when missing (with progress: a
    bar on a terminal, else lines through `emit`)."""
    if not has_warm_start(env):
        raise ValueError(
            f"no warm start for env {env!r}; environments with one: {', '.join(EXPERTS)}"
        )
    recipe = recipe or RECIPES[env]
    full = full_stage(env, cache_root, recipe)
    if finished_result(full) is not None:
        return full.out
    short = short_stage(env, cache_root, recipe)
    with torch_threads(warm_start_threads()):
        if short is not None and finished_result(short.config) is None:
            _ensure_demos(short.config.data, short.recipe)
            title = f"warm start ({short.env}): sft, short contexts"
            run_with_progress(short.config, title, emit)
        _ensure_demos(full.data, recipe)
        if recipe.tokenizer_vocab_size is not None:
            tokenizer_dir = full.data.parent / TOKENIZER_DIR
            ensure_transcript_tokenizer(full.data, tokenizer_dir, recipe.tokenizer_vocab_size)
        run_with_progress(full, f"warm start ({env}): sft, full transcripts", emit)
    return full.out


def warm_start_threads() -> int:
    """Math threads of the warm start's SFT: OMP_NUM_THREADS when set, else two when the
    machine has them. Nothing else runs while the demo builds its warm start (the services
    start after), so the second core is free: on the 2-core VM, idle, a short-context step
    took 0.20 s on two threads against 0.32 s on one. Beyond two is not measured (the tiny
    model's matrices are small); under load from other processes one thread is better (an
    SFT step cost ~3.7 CPU-s on two threads against ~0.5 on one at load ~10), which is what
    OMP_NUM_THREADS=1 says."""
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


def _ensure_demos(path: Path, recipe: WarmStartRecipe) -> None:
    if not path.exists():
        partial = path.with_suffix(".partial")
        asyncio.run(write_demonstrations(recipe.demos, partial))
        partial.rename(path)


def worker_harness_env(env: str) -> dict[str, str]:
    """The rollout-worker variables that give `env`'s episodes the harness limits its
    demonstrations were recorded with (context budget, summaries)."""
    if env not in EXPERTS:
        return {}
    agent = harness_settings(env)
    prefix = "RLPIPE_ROLLOUT_WORKER_"
    return {
        f"{prefix}MAX_TURNS": str(agent.max_turns),
        f"{prefix}CONTEXT_BUDGET_TOKENS": str(agent.context_budget_tokens),
        f"{prefix}SUMMARIZE": "true" if agent.summarize else "false",
        f"{prefix}SUMMARY_MAX_TOKENS": str(agent.summary_max_tokens),
        f"{prefix}MAX_SUMMARIES": str(agent.max_summaries),
    }
