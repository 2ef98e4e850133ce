"""What every rollout shares: how a runner samples, how episodes end, and rollout ids.

The one runner is `libs.rollout.agent.AgentRunner`: single-turn text tasks are one-turn
episodes of the same harness. Rollout ids are `<task_id>.<i>`, so a redelivered task rolls
out under the same ids and the stream's dedup drops the repeats.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from libs.engine.base import Completion, SamplingParams

RolloutFinish = Literal["stop", "length", "max_turns", "env_error", "timeout"]
GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]


@dataclass(frozen=True)
class RunnerSettings:
    """How a runner samples and how long it waits for the environment."""

    worker_id: str
    temperature: float = 1.0
    top_p: float = 1.0
    reset_timeout_s: float = 10.0
    step_timeout_s: float = 30.0


def rollout_id(task_id: str, sample_index: int) -> str:
    """Id of sample `sample_index` of task `task_id`: the same on every delivery."""
    return f"{task_id}.{sample_index}"
