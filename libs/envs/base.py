"""The environment plug-in interface.

An environment opens episodes on tasks (`reset`) and answers actions (`Episode.step`); it may
also generate its own tasks (`task_source`), which is what the env-gateway's feeder publishes.
An environment belongs to a domain (libs.domains): env-gateway serves every domain's
environment over the bus.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from proto.messages import ChatMessage, Task, ToolCall, ToolResult, ToolSpec

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Opening:
    """What the policy sees first, and how long its first action may be.

    A single-turn text environment sets `observation` (the prompt); a tool-calling one sets
    `messages` (the opening conversation), the `tools` it offers and `max_turns`.
    """

    observation: str = ""
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    max_turns: int = 0


@dataclass(frozen=True)
class StepResult:
    """What an action led to; `done` ends the episode.

    `tool_results` holds one result per tool call of the step, in order; `observation` is a
    further message to the policy (e.g. "your answer is not final yet"), usually empty when
    there are tool results. The `info` of the step that ends the episode reaches reward.
    """

    observation: str = ""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    tool_results: tuple[ToolResult, ...] = ()


class Episode(abc.ABC):
    """One running episode: its state lives here, between steps."""

    @abc.abstractmethod
    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        """Apply the policy's `action` (its generated text) and the well-formed `tool_calls`
        parsed from it (none: the action is the policy's final answer)."""

    async def close(self) -> None:  # noqa: B027  # optional hook: most episodes hold nothing
        """Release what the episode holds (sandbox, files). Called once, also after errors."""


class TaskSource(abc.ABC):
    """Deterministic tasks by index: task `i` is the same in every process, so a feeder
    that stored how far it got resumes without repeating or skipping a task."""

    @abc.abstractmethod
    def task(self, index: int) -> Task:
        """The task at position `index` (>= 0)."""


class SeededTaskSource(TaskSource):
    """A TaskSource whose tasks are drawn from generators seeded by (env, seed, difficulty,
    key): the same in every process and Python run (a str seed is hashed with sha512). Task
    `i` is `<env>-d<difficulty>-s<seed>-<i>`; subclasses say what it holds (`draw`)."""

    env: ClassVar[str]
    max_difficulty: ClassVar[int]

    def __init__(self, *, difficulty: int, group_size: int, seed: int) -> None:
        if not 0 <= difficulty <= self.max_difficulty:
            raise ValueError(f"difficulty must be in [0, {self.max_difficulty}], got {difficulty}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.difficulty = difficulty
        self.group_size = group_size
        self.seed = seed

    def rng(self, key: int) -> random.Random:
        """The generator of draw `key` (a task index, or a pass over a fixed task list)."""
        return random.Random(f"{self.env}:{self.seed}:{self.difficulty}:{key}")

    @abc.abstractmethod
    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        """(prompt, spec) of task `index` (>= 0)."""

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        prompt, spec = self.draw(index)
        return Task(
            task_id=f"{self.env}-d{self.difficulty}-s{self.seed}-{index}",
            env=self.env,
            prompt=prompt,
            group_size=self.group_size,
            spec=spec,
        )


class Environment(abc.ABC):
    """An environment kind, e.g. `arith`. One instance serves many episodes concurrently."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        """Open an episode on `task`. Raise ValueError for a task this env cannot run."""

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        """Tasks this environment generates itself, for the feeder."""
        raise NotImplementedError(
            f"environment {self.name!r} generates no tasks; publish its tasks to the bus yourself "
            "and run env-gateway with feeder.mode=off"
        )
