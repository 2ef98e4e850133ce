"""The warm start of `rlpipe demo --env calc|recall`: demonstrations, then SFT, cached.

The embedded random-init policy never writes a tool call, so RL on a tool environment has
nothing to reinforce. The demo therefore starts from a policy fine-tuned on a scripted
expert's demonstrations (libs.experts, recorded through the real environment) by the SFT
stage (libs.sft), the way a user starts from their own pretrained base:

    path = ensure_warm_start("calc", cache_root)    # built once (minutes), then reused

The folder `<cache_root>/<env>-<fingerprint>/` holds `demos.jsonl` and the model; the
fingerprint covers the recipe (demonstrations and SFT settings), so changing the recipe builds
a new one. An interrupted build resumes (the SFT checkpoint).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from libs.experts.demos import EXPERTS, DemoConfig, harness_settings, write_demonstrations
from libs.sft.cli import run_with_progress
from libs.sft.train import SftConfig, finished_result

DEMOS_FILE = "demos.jsonl"
MODEL_DIR = "model"


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the warm start of one environment is made."""

    demos: DemoConfig
    sft_steps: int
    sft_batch_size: int = 8
    sft_learning_rate: float = 3e-3

    def fingerprint(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Tuned on a 2-core machine: a policy that writes valid calls but still fails often enough
# that RL has room (the experts slip on purpose; SFT is kept short).
RECIPES: dict[str, WarmStartRecipe] = {
    "calc": WarmStartRecipe(DemoConfig(env="calc", num_tasks=400, error_rate=0.1), sft_steps=120),
    "recall": WarmStartRecipe(
        DemoConfig(env="recall", num_tasks=300, error_rate=0.1), sft_steps=150
    ),
}


def default_cache_root() -> Path:
    """`$RLPIPE_CACHE_DIR/warm_start`, else `~/.cache/rlpipe/warm_start`."""
    base = os.environ.get("RLPIPE_CACHE_DIR") or Path.home() / ".cache" / "rlpipe"
    return Path(base) / "warm_start"


def has_warm_start(env: str) -> bool:
    return env in RECIPES and env in EXPERTS


def warm_start_dir(env: str, cache_root: Path, recipe: WarmStartRecipe | None = None) -> Path:
    recipe = recipe or RECIPES[env]
    return cache_root / f"{env}-{recipe.fingerprint()}"


def sft_config(folder: Path, recipe: WarmStartRecipe) -> SftConfig:
    return SftConfig(
        data=folder / DEMOS_FILE,
        out=folder / MODEL_DIR,
        steps=recipe.sft_steps,
        batch_size=recipe.sft_batch_size,
        learning_rate=recipe.sft_learning_rate,
    )


def ensure_warm_start(env: str, cache_root: Path, recipe: WarmStartRecipe | None = None) -> Path:
    """The model folder of `env`'s warm start, built first when missing (with progress)."""
    if not has_warm_start(env):
        raise ValueError(
            f"no warm start for env {env!r}; environments with one: {', '.join(RECIPES)}"
        )
    recipe = recipe or RECIPES[env]
    folder = warm_start_dir(env, cache_root, recipe)
    config = sft_config(folder, recipe)
    if finished_result(config) is not None:
        return config.out
    demos = folder / DEMOS_FILE
    if not demos.exists():
        partial = demos.with_suffix(".partial")
        asyncio.run(write_demonstrations(recipe.demos, partial))
        partial.rename(demos)
    run_with_progress(config, title=f"warm start ({env}): sft")
    return config.out


def scaled_recipe(env: str, sft_steps: int, num_tasks: int) -> WarmStartRecipe:
    """`env`'s recipe with fewer SFT steps and demonstrations (tests, CI)."""
    recipe = RECIPES[env]
    return replace(recipe, sft_steps=sft_steps, demos=replace(recipe.demos, num_tasks=num_tasks))


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
