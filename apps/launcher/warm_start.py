"""The warm start of `rlpipe demo --env calc|recall`: demonstrations, then SFT, cached.

The embedded random-init policy never writes a tool call, so RL on a tool environment has
nothing to reinforce. The demo therefore starts from a policy fine-tuned on a scripted
expert's demonstrations (libs.experts, recorded through the real environment) by the SFT
stage (libs.sft), the way a user starts from their own pretrained base:

    path = ensure_warm_start("calc", cache_root)    # built once (minutes), then reused

The folder `<cache_root>/<env>-<fingerprint>/` holds `demos.jsonl`, the tokenizer trained on
them (libs.sft.tokenizer), and the model folder, which carries that tokenizer; the
fingerprint covers the recipe (demonstration and SFT settings)
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

from apps.sft_cli import LogFn, run_with_progress
from libs.chat.template import chat_template_for
from libs.domains.registry import harness_for
from libs.experts.demos import (
    DemoConfig,
    demonstrations_digest,
    expert_domains,
    write_demonstrations,
)
from libs.policy import PolicyConfig
from libs.sft.tokenizer import ensure_transcript_tokenizer
from libs.sft.train import SftConfig, finished_result
from libs.tokenizer import load_tokenizer

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
# Trainer settings of one environment's RL that differ from the above. recall sharpens its
# warm start's copying (diffuse at temperature 1: ~30 digits written an episode, each can
# slip) and needs more steps at full rate than a 6-minute demo makes under the trainer's
# 400-step decay. `rlpipe demo --env recall --duration-s 360` from the same warm start (256
# held-out tasks at temperature 1, warm start 0.277): the anchor and the 400-step decay, 208
# steps -> 0.359; the anchor and a 1,000-step decay, 315 steps -> 0.523 (trained episodes'
# success rising through the run). Without the anchor the steps are cheaper (no reference
# forward) but the policy went off the edge: 372 and 386 steps -> 0.484 and 0.488, a third
# run collapsed at step ~310 (grad norm 15, success 0.0 held out). In-process, a higher rate
# undid it (2e-4: 0.31 -> 0.18, 3e-4: 0.23 -> 0.13 in 90 steps of 2 groups of 8).
RL_TRAINER_OVERRIDES: dict[str, dict[str, str]] = {
    "recall": {"RLPIPE_TRAINER_LEARNING_RATE_DECAY_STEPS": "1000"},
}
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the warm start of one environment is made: demonstrations, a tokenizer trained on
    them, then SFT of the random-init tiny policy over that tokenizer."""

    demos: DemoConfig
    steps: int
    tokenizer_vocab_size: int = 1024
    batch_size: int = 32
    learning_rate: float = 3e-3

    def fingerprint(self) -> str:
        """A digest of the recipe's settings and of what its demonstrations are (a sample of
        them rendered: libs.experts.demos.demonstrations_digest)."""
        fields = asdict(self)
        fields["demonstrations"] = demonstrations_digest(self.demos)
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Tuned on a 2-core machine. Episodes are written in a BPE tokenizer trained on the
# demonstrations (libs.sft.tokenizer): a calc episode is 73 tokens (20 generated) against 684
# bytes, so an SFT step of 32 takes 0.14 s, and the tiny model learns in one stage what a
# byte-level recipe needed two for, and better: after 1,200 steps it copies the tool's result
# into its answer in 127 of 128 held-out tasks (400 steps: 72 of 128; the byte-level recipe:
# greedy success 0.52 after 6.3 minutes, and no RL setting raised it by more than ~0.1). RL
# can only sharpen what the warm start already does right; the room it leaves comes from the
# expert's slips (an operand off by 1-3, or multiply for divide, in error_rate of the calls),
# which the policy imitates at temperature 1 and RL removes: on 256 held-out tasks at
# temperature 1, success 0.44-0.50 (the failures are the imitated slips), 0.85 after a 300 s
# demo. recall (2 segments an episode at its budget) is read with running notes
# (libs.domains.recall.expert): 1,100 steps of 32 (12.7 minutes on one thread; the copying sets in
# after 600-700 steps, 600 steps left success at 0.01) copy 98% of the revealed digits
# teacher-forced; greedy success 0.73, at temperature 1 0.27 on 256 held-out tasks (digits
# miscopied anywhere among ~30 written: what RL sharpens), 0.52 after a 360 s demo
# (315 steps, RL_TRAINER_OVERRIDES). A slip in 7% of the reads (~35% of the episodes)
# leaves room as calc's do. Without the notes (1,500 steps, 2% slips) the last digit was
# never learnt (5 of 64 teacher-forced): 0.094 with summaries, 0.094 after 314 demo steps.
RECIPES: dict[str, WarmStartRecipe] = {
    "calc": WarmStartRecipe(DemoConfig(env="calc", num_tasks=5000, error_rate=0.4), steps=1200),
    "recall": WarmStartRecipe(
        DemoConfig(env="recall", num_tasks=2000, error_rate=0.07), steps=1100
    ),
}


def default_cache_root() -> Path:
    """`$RLPIPE_CACHE_DIR/warm_start`, else `~/.cache/rlpipe/warm_start`."""
    base = os.environ.get("RLPIPE_CACHE_DIR") or Path.home() / ".cache" / "rlpipe"
    return Path(base) / "warm_start"


def has_warm_start(env: str) -> bool:
    return env in RECIPES and env in expert_domains()


def warm_start_dir(env: str, cache_root: Path, recipe: WarmStartRecipe | None = None) -> Path:
    recipe = recipe or RECIPES[env]
    return cache_root / f"{env}-{recipe.fingerprint()}"


def sft_stage(env: str, cache_root: Path, recipe: WarmStartRecipe) -> SftConfig:
    """The SFT run of `env`'s warm start: the random-init tiny policy over the recipe's
    tokenizer, on its demonstrations."""
    folder = warm_start_dir(env, cache_root, recipe)
    return SftConfig(
        data=folder / DEMOS_FILE,
        out=folder / MODEL_DIR,
        policy=PolicyConfig(tokenizer=str(folder / TOKENIZER_DIR)),
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
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
            f"no warm start for env {env!r}; environments with one: {', '.join(expert_domains())}"
        )
    recipe = recipe or RECIPES[env]
    sft = sft_stage(env, cache_root, recipe)
    if finished_result(sft) is not None:
        return sft.out
    with torch_threads(warm_start_threads()):
        _ensure_demos(sft.data, recipe)
        tokenizer = sft.data.parent / TOKENIZER_DIR
        ensure_transcript_tokenizer(sft.data, tokenizer, recipe.tokenizer_vocab_size)
        run_with_progress(sft, f"warm start ({env}): sft", emit)
    return sft.out


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


def rl_trainer_env(env: str, policy_path: Path) -> dict[str, str]:
    """The trainer variables of RL on `env` from its warm start at `policy_path`."""
    return {
        "RLPIPE_TRAINER_POLICY_PATH": str(policy_path),
        "RLPIPE_TRAINER_LEARNING_RATE": RL_LEARNING_RATE,
        "RLPIPE_TRAINER_KL_COEF": RL_KL_COEF,
        **RL_TRAINER_OVERRIDES.get(env, {}),
    }


def worker_harness_env(env: str, policy_path: Path) -> dict[str, str]:
    """The rollout-worker variables that give `env`'s episodes the harness limits its
    demonstrations were recorded with (context budget, summaries), in the tokens of the
    policy folder's tokenizer."""
    if env not in expert_domains():
        return {}
    agent = harness_for(env, chat_template_for(load_tokenizer(str(policy_path))))
    prefix = "RLPIPE_ROLLOUT_WORKER_"
    return {
        f"{prefix}MAX_TURNS": str(agent.max_turns),
        f"{prefix}CONTEXT_BUDGET_TOKENS": str(agent.context_budget_tokens),
        f"{prefix}SUMMARIZE": "true" if agent.summarize else "false",
        f"{prefix}SUMMARY_MAX_TOKENS": str(agent.summary_max_tokens),
        f"{prefix}MAX_SUMMARIES": str(agent.max_summaries),
    }
