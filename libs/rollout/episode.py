"""What every rollout shares: how a runner samples, how episodes end, and rollout ids.

The one runner is `libs.rollout.agent.AgentRunner`: single-turn text tasks are one-turn
episodes of the same harness. Rollout ids are `<task_id>.<i>`, so a redelivered task rolls
out under the same ids and the stream's dedup drops the repeats.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from libs.engine.base import Completion, SamplingParams

RolloutFinish = Literal["stop", "length", "max_turns", "env_error", "timeout"]
GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]


def default_worker_id() -> str:
    """`<hostname>-<pid>`: unique per process on a host."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RunnerSettings(BaseModel):
    """How a runner samples and how long it waits for the environment (the rollout-worker's
    settings carry these fields as they are)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str = Field(
        default_factory=default_worker_id, description="Name in rollouts and logs"
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass")
    env_reset_timeout_s: float = Field(10.0, gt=0, description="Longest wait for a reset reply")
    env_step_timeout_s: float = Field(30.0, gt=0, description="Longest wait for a step reply")


def rollout_id(task_id: str, sample_index: int) -> str:
    """Id of sample `sample_index` of task `task_id`: the same on every delivery."""
    return f"{task_id}.{sample_index}"
