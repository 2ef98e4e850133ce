"""The built-in Python coding environment: files, tools and hidden tests, in a sandbox.

A task (see tasks.py) is a folder of files plus hidden cases, from a task set: the shipped
folders by default (the `functions` domain serves generated ones through this env). Each
episode gets its own sandbox (libs.sandbox) seeded with the task's files; the policy works
with the tools of tools.py and ends the episode with a turn without tool calls. That final
step grades the files (grading.py) and returns `info = {"answer_correct", "tests_passed",
"tests_total", "grading_error", "grading_notes"}` (correct: every hidden test passed), which
reward reads from Rollout.env_info.

An episode that ends any other way (closed at max_turns, expired, an env error) is not
graded: nobody would receive the result, since only a step's reply carries info. The
harness records such a rollout's finish reason; its env_info has no `tests_total`.

Configured by RLPIPE_ENV_CODING_* variables (nested fields with `__`, e.g.
RLPIPE_ENV_CODING_TOOL_LIMITS__WALL_S=5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from libs.domains.coding.grading import grade_files
from libs.domains.coding.tasks import ENV_NAME, CodingTask, ShippedTasks, TaskSet
from libs.domains.coding.tools import TOOLS, SandboxTools, ToolLimits
from libs.envs.base import Environment, Episode, Opening, StepResult, TaskSource
from libs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxFactory,
    SandboxLimits,
    build_sandbox_factory,
)
from libs.sandbox.limits import MIB
from proto.messages import ChatMessage, Task, ToolCall

SYSTEM_PROMPT = (
    "You are a Python programmer working in a project folder. Use the tools to read the files, "
    "change them and run the visible tests. Hidden tests check your work after your final "
    "answer. When you are done, reply with a short summary and no tool call."
)


class CodingConfig(BaseSettings):
    """Limits of the coding environment's sandboxes, tools and grading."""

    model_config = SettingsConfigDict(
        env_prefix="RLPIPE_ENV_CODING_", env_nested_delimiter="__", extra="ignore"
    )

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Backend and folders of the sandboxes (its `limits` are replaced by the two below)."""
    tool_limits: SandboxLimits = SandboxLimits(
        cpu_s=10, memory_bytes=512 * MIB, max_processes=64, file_size_bytes=16 * MIB, wall_s=10.0
    )
    """Limits of each command a tool runs (run_python, run_tests, the file tools)."""
    grade_limits: SandboxLimits = SandboxLimits(
        cpu_s=15, memory_bytes=512 * MIB, max_processes=16, file_size_bytes=16 * MIB, wall_s=20.0
    )
    """Limits of the grading run; its wall clock must fit the gateway's step timeout."""
    case_timeout_s: float = Field(2.0, gt=0)
    """Wall-clock limit of each hidden case."""
    step_budget_s: float = Field(20.0, gt=0)
    """Seconds all tool calls of one turn may take together (under the gateway's step timeout)."""
    max_output_chars: int = Field(4000, ge=100)
    """Characters of stdout and of stderr a tool result keeps (head and tail)."""
    max_read_bytes: int = Field(64 * 1024, ge=1)
    """Bytes read_file returns at most."""
    max_turns: int = Field(30, ge=1)
    """Assistant turns an episode allows."""
    max_tokens: int = Field(1024, ge=1)
    """Tokens the policy may generate per turn."""


@dataclass(frozen=True)
class SandboxFactories:
    """One factory per set of limits: the tools' and the grading run's."""

    tools: SandboxFactory
    grading: SandboxFactory


class CodingEpisode(Episode):
    """One task in one sandbox; the final answer grades its files."""

    def __init__(
        self, env: CodingEnv, task: CodingTask, sandbox: Sandbox, stack: contextlib.AsyncExitStack
    ) -> None:
        self.env = env
        self.task = task
        self.sandbox = sandbox
        self._stack = stack
        limits = ToolLimits(
            env.config.max_output_chars, env.config.max_read_bytes, env.config.step_budget_s
        )
        self.tools = SandboxTools(sandbox, limits)

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        if tool_calls:
            return StepResult(tool_results=await self.tools.run_all(tool_calls))
        config = self.env.config
        grade = await grade_files(
            self.task,
            self.sandbox.workdir,
            self.env.factories().grading,
            case_timeout_s=config.case_timeout_s,
            wall_s=config.grade_limits.wall_s,
        )
        return StepResult(done=True, info={"task": self.task.name, **grade.info()})

    async def close(self) -> None:
        await self._stack.aclose()


class CodingEnv(Environment):
    """Serves a set of coding tasks (default: the shipped ones); sandboxes are built on first
    use."""

    name: ClassVar[str] = ENV_NAME

    def __init__(self, config: CodingConfig | None = None, tasks: TaskSet | None = None) -> None:
        self.config = config or CodingConfig()
        self.tasks = tasks or ShippedTasks()
        self._factories: SandboxFactories | None = None

    def factories(self) -> SandboxFactories:
        """The tool and grading sandbox factories (built once; raises SandboxError when the
        backend is missing, e.g. no bubblewrap)."""
        if self._factories is None:
            sandbox = self.config.sandbox
            self._factories = SandboxFactories(
                tools=build_sandbox_factory(
                    sandbox.model_copy(update={"limits": self.config.tool_limits})
                ),
                grading=build_sandbox_factory(
                    sandbox.model_copy(update={"limits": self.config.grade_limits})
                ),
            )
        return self._factories

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        coding_task = self.tasks.find(task.spec)
        if coding_task is None:
            raise ValueError(
                f"{self.name} task {task.task_id}: its spec names no task of this environment "
                f"({type(self.tasks).__name__}), got {task.spec!r}"
            )
        stack = contextlib.AsyncExitStack()
        try:
            sandbox = await stack.enter_async_context(
                self.factories().tools.open(coding_task.files_dir)
            )
        except BaseException:
            await stack.aclose()
            raise
        episode = CodingEpisode(self, coding_task, sandbox, stack)
        return episode, self._opening(coding_task)

    def _opening(self, task: CodingTask) -> Opening:
        files = ", ".join(task.file_names())
        user = (
            f"{task.prompt}\n\nFiles in the working folder: {files}. "
            "Run the visible tests with run_tests; your final answer is a reply without a "
            "tool call."
        )
        return Opening(
            messages=(
                ChatMessage(role="system", content=SYSTEM_PROMPT),
                ChatMessage(role="user", content=user),
            ),
            tools=TOOLS,
            max_turns=self.config.max_turns,
            max_tokens=self.config.max_tokens,
        )

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return self.tasks.source(difficulty=difficulty, group_size=group_size, seed=seed)
