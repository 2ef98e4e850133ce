"""echo's environment: the task names a word; the policy's one answer ends the episode with
`info = {"said_it": bool}`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from libs.envs.base import Environment, Episode, Opening, StepResult, TaskSource
from proto.messages import Task, ToolCall

WORDS = ("apple", "river", "stone", "cloud")


class EchoTasks(TaskSource):
    """Task `i` asks for word `i % len(WORDS)`: the same in every process."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def task(self, index: int) -> Task:
        word = WORDS[index % len(WORDS)]
        return Task(
            task_id=f"echo-{index}",
            env="echo",
            prompt=f"Say {word}.",
            group_size=self.group_size,
            spec={"word": word},
        )


class EchoEpisode(Episode):
    def __init__(self, word: str) -> None:
        self.word = word

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        said = action.strip().rstrip(".").lower()
        return StepResult(done=True, info={"said_it": said == self.word})


class EchoEnv(Environment):
    name: ClassVar[str] = "echo"

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        word = task.spec.get("word")
        if not isinstance(word, str):
            raise ValueError(f"echo task {task.task_id} has no word in spec['word']")
        return EchoEpisode(word), Opening(observation=task.prompt, max_tokens=16)

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return EchoTasks(group_size)
