"""Evaluation: episodes of held-out tasks through the one harness, scored by the env's rubric.

    scored = await evaluate(engine, tokenizer, tasks, env_client, agent)   # greedy
    mean_reward(scored)              # the eval gate's score
    episode_figures(scored)          # success, tool-call validity, turns (libs.rollout.figures)

Every evaluation in the project runs here, the way rollouts run: the engine behind the
generation batcher (episodes' turns share engine calls), `AgentRunner` (chat or plain-text
episodes), the environment behind an `EnvClient` (env-gateway over the bus for the trainer's
eval gate; `LocalEnvClient` for an in-process measurement such as `rlpipe domain
evaluate`), and the domain's own rubric without judge criteria
(`libs.domains.registry.rubric_for`). A criterion that cannot score leaves its rollout
unscored with the reason (reward 0), as the reward service does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from libs.domains.registry import rubric_for
from libs.engine.base import InferenceEngine
from libs.envs.client import EnvClient
from libs.reward.rubric import score_rollout
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import RunnerSettings
from libs.tokenizer import Tokenizer
from proto.messages import ScoredRollout, Task


async def evaluate(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    env_client: EnvClient,
    agent: AgentSettings,
    *,
    temperature: float = 0.0,
    worker_id: str = "evaluate",
) -> list[ScoredRollout]:
    """Each task's `group_size` episodes, scored, in task order (EnvError when the episodes
    cannot run: no environment serves them)."""
    batcher = GenerationBatcher(engine)
    batcher.open.set()
    running = asyncio.create_task(batcher.run(), name="evaluation-batcher")
    settings = RunnerSettings(worker_id=worker_id, temperature=temperature)
    runner = AgentRunner(env_client, tokenizer, batcher.generate, settings, agent)
    try:
        groups = await asyncio.gather(*(runner.run(task) for task in tasks))
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    scored = []
    for task, group in zip(tasks, groups, strict=True):
        rubric = rubric_for(task.env)
        scored += [await score_rollout(rubric, rollout, task, time.time()) for rollout in group]
    return scored


def mean_reward(scored: Sequence[ScoredRollout]) -> float:
    """The mean reward of `scored` (0 for none)."""
    return sum(s.reward for s in scored) / max(len(scored), 1)
