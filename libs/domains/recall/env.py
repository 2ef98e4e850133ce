"""The long-horizon tool environment: read a code one digit per call, then answer with all of it.

A task hides a code of `NUM_DIGITS_BASE + difficulty` digits. The one tool, `next_digit`
(no arguments), reveals the next digit as `digit 3 of 6: 7`; after the last one it answers
`no digits left`. A turn without a tool call is the answer, which ends the episode with
`info = {"answer_correct": bool, "expected": str, "answer": str, "digits_correct": float,
"num_tool_calls": int}` (digits_correct: share of positions answered right).

Why it is long-horizon: the harness limits it is made for (harness.py) give a context
segment room for the opening (with a summary), a few reveals and one more turn, counted in
the policy's own tokens, so the digits do not all fit in one context segment. The harness then
asks the policy for a summary and restarts from the opening plus that summary
(libs.rollout.agent): an episode succeeds only when its summaries carry the digits read so
far. With summarization off, the same budget ends the episode (finish `length`) before the
last digit.

    rlpipe domain demos --env recall --num-tasks 4 --out /tmp/recall.jsonl
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

from libs.envs.base import Environment, Episode, Opening, SeededTaskSource, StepResult, TaskSource
from proto.messages import (
    TOOL_ERROR_BAD_ARGUMENTS,
    TOOL_ERROR_UNKNOWN_TOOL,
    ChatMessage,
    Task,
    ToolCall,
    ToolResult,
    ToolSpec,
)

ENV_NAME = "recall"
NUM_DIGITS_BASE = 6
MAX_DIFFICULTY = 6
TOOL_NAME = "next_digit"
TURN_MAX_TOKENS = 80

TOOLS = (
    ToolSpec(
        name=TOOL_NAME,
        description="Reveals the next digit of the code.",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
    ),
)
SYSTEM_PROMPT = "Read the code with the tool, one digit per call. Then answer with the code."
_DIGITS = re.compile(r"\d+")


class RecallTasks(SeededTaskSource):
    """Codes of NUM_DIGITS_BASE + difficulty digits; task `i` from its own seeded generator."""

    env: ClassVar[str] = ENV_NAME
    max_difficulty: ClassVar[int] = MAX_DIFFICULTY

    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        rng = self.rng(index)
        code = "".join(str(rng.randint(0, 9)) for _ in range(NUM_DIGITS_BASE + self.difficulty))
        return f"The code has {len(code)} digits.", {"code": code}


def parse_code(text: str) -> str:
    """The digits of the answer: the longest run of digits in `text` (spaces between digits
    are allowed: "7 3 9" -> "739")."""
    runs = _DIGITS.findall(re.sub(r"(?<=\d)[ ,](?=\d)", "", text))
    return max(runs, key=len, default="")


class RecallEpisode(Episode):
    """Reveals one digit per `next_digit` call; a turn without calls is the answer."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.position = 0  # digits revealed so far
        self.num_tool_calls = 0

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        if tool_calls:
            self.num_tool_calls += len(tool_calls)
            return StepResult(tool_results=tuple(self._reveal(call) for call in tool_calls))
        answer = parse_code(action)
        right = sum(a == b for a, b in zip(answer, self.code, strict=False))
        info = {
            "answer_correct": answer == self.code,
            "expected": self.code,
            "answer": answer,
            "digits_correct": right / len(self.code),
            "num_tool_calls": self.num_tool_calls,
        }
        return StepResult(done=True, info=info)

    def _reveal(self, call: ToolCall) -> ToolResult:
        def result(content: str, error: str = "") -> ToolResult:
            return ToolResult(call_id=call.call_id, name=call.name, content=content, error=error)

        if call.name != TOOL_NAME:
            return result(
                f"unknown tool {call.name!r}; tools: {TOOL_NAME}", TOOL_ERROR_UNKNOWN_TOOL
            )
        if call.arguments:
            return result(f"{TOOL_NAME} takes no arguments", TOOL_ERROR_BAD_ARGUMENTS)
        if self.position >= len(self.code):
            return result("no digits left")
        self.position += 1
        digit = self.code[self.position - 1]
        return result(f"digit {self.position} of {len(self.code)}: {digit}")


class RecallEnv(Environment):
    """Serves code-reading episodes that outgrow one context segment."""

    name: ClassVar[str] = ENV_NAME

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        code = task.spec.get("code")
        if not isinstance(code, str) or not code.isdigit():
            raise ValueError(f"recall task {task.task_id} has no digit string in spec['code']")
        opening = Opening(
            messages=(
                ChatMessage(role="system", content=SYSTEM_PROMPT),
                ChatMessage(role="user", content=task.prompt),
            ),
            tools=TOOLS,
            max_turns=len(code) + 4,
            max_tokens=TURN_MAX_TOKENS,
        )
        return RecallEpisode(code), opening

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return RecallTasks(difficulty=difficulty, group_size=group_size, seed=seed)
