"""The built-in verifiable task: copy a digit, or add two d-digit numbers.

Difficulty 0 is "copy": prompt `7=`, answer `7`. Difficulty d >= 1 adds two d-digit numbers:
`12+30=` -> `42`. Prompts carry no instructions: the embedded default policy is a byte-level
model trained from scratch, which must find the answer format by reward alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from libs.envs.base import (
    Environment,
    Episode,
    Opening,
    SeededTaskSource,
    StepResult,
    TaskSource,
)
from proto.messages import Task, ToolCall

ENV_NAME = "arith"
MAX_DIFFICULTY = 18
_LEADING_DIGITS = re.compile(r"[0-9]*")


def leading_digits(text: str) -> str:
    """The digits `text` starts with, cut at the first non-digit ("42x7" -> "42")."""
    match = _LEADING_DIGITS.match(text)
    return match.group() if match else ""


def make_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    """(prompt, answer) of one problem drawn from `rng`."""
    if difficulty == 0:
        digit = str(rng.randrange(10))
        return f"{digit}=", digit
    low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
    high = 10**difficulty
    a, b = rng.randrange(low, high), rng.randrange(low, high)
    return f"{a}+{b}=", str(a + b)


class ArithmeticTasks(SeededTaskSource):
    """Arithmetic tasks, task `i` drawn from its own seeded generator (order-independent)."""

    env: ClassVar[str] = ENV_NAME
    max_difficulty: ClassVar[int] = MAX_DIFFICULTY

    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        prompt, answer = make_problem(self.rng(index), self.difficulty)
        return prompt, {
            "answer": answer,
            "difficulty": self.difficulty,
            "max_tokens": len(answer) + 1,
        }


class ArithmeticEpisode(Episode):
    """A single-turn episode: one answer, then done."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        # The verdict travels on the rollout (env_info): reward reads it instead of re-checking.
        correct = leading_digits(action) == self.answer
        return StepResult(done=True, info={"answer_correct": correct, "expected": self.answer})


class ArithmeticEnv(Environment):
    """Serves arithmetic tasks: the observation is the prompt; the answer ends the episode."""

    name: ClassVar[str] = ENV_NAME

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        answer = task.spec.get("answer")
        if not isinstance(answer, str) or not answer.isdigit():
            raise ValueError(f"arith task {task.task_id} has no digit answer in spec['answer']")
        max_tokens = int(task.spec.get("max_tokens", len(answer) + 1))
        return ArithmeticEpisode(answer), Opening(observation=task.prompt, max_tokens=max_tokens)

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return ArithmeticTasks(difficulty=difficulty, group_size=group_size, seed=seed)
