"""The workers' harness limits in a demo: the ones the recipe's domain is made for.

A domain says its harness limits (turns, context budget, summaries: libs.domains) in the
tokens of a policy's chat template; the eval gate rolls the domain out under them. The
launcher puts the same limits in the recipe's `[rollout_worker]` table, counted in the tokens
of the policy the workers load (their settings as the recipe and the environment give them),
so the episodes trained and the episodes judged are alike. Variables and `--set` still win.

    recipe = merge_tables(recipe, harness_tables(recipe))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apps.launcher.recipe import recipe_in_use


def harness_tables(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The `[rollout_worker]` table of the harness limits of `recipe`'s domain (its
    `[env_gateway] env`), counted in the tokens of the policy its workers load; {} when the
    recipe names no domain."""
    env = recipe.get("env_gateway", {}).get("env")
    if env is None:
        return {}
    return {"rollout_worker": harness_table(env, worker_tokenizer(recipe))}


def worker_tokenizer(recipe: Mapping[str, Any]) -> str:
    """The tokenizer of the policy the workers of `recipe` load (their settings as the recipe,
    the environment and `--set` give them)."""
    # Imported here: the worker's settings pull in torch (the launcher's check loaded it).
    from apps.launcher.weight_keys import run_keys_assumed
    from libs.policy import tokenizer_spec
    from libs.settings import load_settings
    from services.rollout_worker.settings import RolloutWorkerSettings

    with recipe_in_use(recipe), run_keys_assumed():
        return tokenizer_spec(load_settings(RolloutWorkerSettings).policy)


def harness_table(env: str, tokenizer: str) -> dict[str, Any]:
    """The rollout-worker fields of domain `env`'s harness limits, in `tokenizer`'s tokens
    (a tokenizer spec: "byte" or a folder, such as a model folder carrying its own)."""
    from libs.chat.template import chat_template_for
    from libs.domains.registry import harness_for
    from libs.tokenizer import load_tokenizer

    return harness_for(env, chat_template_for(load_tokenizer(tokenizer))).model_dump()
