"""How good a policy is on a tool environment, measured in this process (no services).

    python -m libs.sft.evaluate --policy-path models/calc-sft --env calc --num-tasks 32

Episodes run through the project's one evaluator (libs.rollout.evaluate: the harness, the
generation batcher, the environment's rubric) with an engine from the engine factory,
against the environment objects in this process (libs.envs.local_client). Reports task
success, mean reward, tool-call validity, tool calls and turns per episode, and segments
(summaries + 1). Used to report the warm start's level and to compare summarization on and
off at the same context budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from libs.chat.template import chat_template_for
from libs.engine.base import InferenceEngine
from libs.engine.factory import EngineConfig, build_engine
from libs.envs import make_env
from libs.envs.local_client import LocalEnvClient
from libs.experts.demos import harness_settings
from libs.logs import configure_logging
from libs.policy import PolicyConfig, load_policy_tokenizer
from libs.rollout.agent import AgentSettings
from libs.rollout.evaluate import evaluate
from libs.rollout.figures import episode_figures
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
    environment served in this process (the one evaluator: libs.rollout.evaluate)."""
    environment = make_env(env)
    source = environment.task_source(difficulty=difficulty, group_size=group_size, seed=seed)
    tasks = [source.task(i) for i in range(num_tasks)]
    client = LocalEnvClient({env: environment})
    settings = agent or harness_settings(env, chat_template_for(tokenizer))
    scored = await evaluate(engine, tokenizer, tasks, client, settings, temperature=temperature)
    return episode_figures(scored)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy-path", default=None)
    parser.add_argument(
        "--tokenizer", default=None, help="'byte' or a folder; default: the model folder's own"
    )
    parser.add_argument("--env", default="calc")
    parser.add_argument("--num-tasks", type=int, default=32)
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-summarize", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("evaluate", level="warning")
    policy = PolicyConfig(path=args.policy_path, tokenizer=args.tokenizer, device="cpu")
    engine = build_engine(EngineConfig(), policy)
    tokenizer = load_policy_tokenizer(policy)
    agent = harness_settings(args.env, chat_template_for(tokenizer))
    if args.no_summarize:
        agent = agent.model_copy(update={"summarize": False})
    figures = asyncio.run(
        measure(
            engine,
            tokenizer,
            args.env,
            num_tasks=args.num_tasks,
            difficulty=args.difficulty,
            temperature=args.temperature,
            agent=agent,
        )
    )
    print(json.dumps({"env": args.env, "summarize": agent.summarize, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
