"""How good a policy is on a domain, measured in this process (no services).

    rlpipe domain evaluate --policy-path models/calc-sft --env calc --num-tasks 32

Episodes run through the project's one evaluator (libs.rollout.evaluate: the harness, the
generation batcher, the environment's rubric) with an engine from the engine factory,
against the environment objects in this process (libs.envs.local_client). Reports task
success, mean reward, tool-call validity, tool calls and turns per episode, and segments
(summaries + 1). Episodes run under the domain's harness limits (libs.domains), as the
workers' do. Used to report the warm start's level and to compare summarization on and off
at the same context budget.
"""

from __future__ import annotations

from typing import Any

from libs.chat.template import chat_template_for
from libs.domains.registry import domain, make_env
from libs.engine.base import InferenceEngine
from libs.envs.local_client import LocalEnvClient
from libs.rollout.agent import AgentSettings
from libs.rollout.evaluate import evaluate
from libs.rollout.figures import episode_figures, family_figures, group_figures
from libs.tokenizer import Tokenizer

EVAL_SEED = 777  # neither the feeder's (0) nor the demonstrations' (1234) tasks


async def measure(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    env: str,
    *,
    num_tasks: int = 32,
    group_size: int = 1,
    difficulty: int = 0,
    seed: int = EVAL_SEED,
    temperature: float = 1.0,
    agent: AgentSettings | None = None,
) -> dict[str, Any]:
    """Figures of `num_tasks` x `group_size` episodes of `env` under `engine`'s policy, the
    environment served in this process (the one evaluator: libs.rollout.evaluate); with
    several samples a task, the tasks solved always, never and sometimes (`groups`); success
    by task family where the tasks name one (`families`)."""
    found = domain(env)
    environment = make_env(env)
    source = environment.task_source(difficulty=difficulty, group_size=group_size, seed=seed)
    tasks = [source.task(i) for i in range(num_tasks)]
    client = LocalEnvClient({env: environment})
    settings = agent or found.harness(chat_template_for(tokenizer))
    scored = await evaluate(engine, tokenizer, tasks, client, settings, temperature=temperature)
    figures = episode_figures(scored)
    if group_size > 1:
        figures["groups"] = group_figures(scored)
    if families := family_figures(scored):
        figures["families"] = families
    return figures
