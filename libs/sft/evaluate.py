"""How good a policy is on a tool environment, measured in this process (no services).

    python -m libs.sft.evaluate --policy-path models/calc-sft --env calc --num-tasks 32

Episodes run through the real harness (libs.rollout.agent.AgentRunner) with the `hf` engine,
against the environment objects in this process (libs.envs.local_client), and are scored by
the environment's rubric. Reports task success, mean reward, tool-call validity, tool calls
and turns per episode, and segments (summaries + 1). Used to report the warm start's level
and to compare summarization on and off at the same context budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from libs.engine.base import SamplingParams
from libs.engine.hf import HFEngine
from libs.envs import make_env
from libs.envs.local_client import LocalEnvClient
from libs.experts.demos import harness_settings
from libs.logs import configure_logging
from libs.policy import PolicyConfig, build_policy
from libs.reward import rubric_for
from libs.reward.rubric import score_rollout
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.episode import RunnerSettings
from libs.rollout.figures import episode_figures
from libs.tokenizer import load_tokenizer

EVAL_SEED = 777  # neither the feeder's (0) nor the demonstrations' (1234) tasks


async def evaluate(
    engine: HFEngine,
    env: str,
    *,
    num_tasks: int = 32,
    group_size: int = 1,
    difficulty: int = 0,
    seed: int = EVAL_SEED,
    temperature: float = 1.0,
    agent: AgentSettings | None = None,
) -> dict[str, Any]:
    """Figures of `num_tasks` x `group_size` episodes of `env` under `engine`'s policy."""
    environment = make_env(env)
    source = environment.task_source(difficulty=difficulty, group_size=group_size, seed=seed)

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Any]:
        return await asyncio.to_thread(engine.generate, prompts, params)

    runner = AgentRunner(
        LocalEnvClient({env: environment}),
        engine.tokenizer,
        generate,
        RunnerSettings(worker_id="evaluate", temperature=temperature),
        agent or harness_settings(env),
    )
    rubric = rubric_for(env)
    tasks = [source.task(i) for i in range(num_tasks)]
    groups = await asyncio.gather(*(runner.run(task) for task in tasks))
    scored = [
        await score_rollout(rubric, rollout, task, time.time())
        for task, group in zip(tasks, groups, strict=True)
        for rollout in group
    ]
    return episode_figures(scored)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy-path", default=None)
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--env", default="calc")
    parser.add_argument("--num-tasks", type=int, default=32)
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-summarize", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("evaluate", level="warning")
    tokenizer = load_tokenizer(args.tokenizer)
    model = build_policy(PolicyConfig(path=args.policy_path, device="cpu"))
    agent = harness_settings(args.env)
    if args.no_summarize:
        agent = agent.model_copy(update={"summarize": False})
    figures = asyncio.run(
        evaluate(
            HFEngine(model, tokenizer),
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
