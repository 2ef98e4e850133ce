"""Scripted expert of the `calc` environment: one tool call per operation, then the number.

It reads the expression of the task's prompt (folded left, as `libs.domains.calc.env` builds it),
calls the tool of each operation on the running value and the next operand, and answers with
the last result. With probability `error_rate` per call it slips on an operand (off by a
small amount), so the episode ends with a wrong answer, reached with valid calls.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from libs.domains.calc.env import ENV_NAME, OPERATIONS
from libs.envs.base import Opening
from libs.experts.record import EpisodeExpert, Expert, ExpertTurn
from libs.sft.transcript import SftCall
from proto.messages import Task, ToolResult

_SYMBOL_TO_TOOL = {symbol: name for name, (symbol, _) in OPERATIONS.items()}


def parse_expression(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    """(first operand, [(tool, operand), ...]) of "What is ((12 + 7) * 3) - 5?"."""
    body = prompt.removeprefix("What is").rstrip("?").replace("(", " ").replace(")", " ")
    tokens = body.split()
    if not tokens:
        raise ValueError(f"no expression in calc prompt {prompt!r}")
    first, steps = int(tokens[0]), []
    for symbol, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        steps.append((_SYMBOL_TO_TOOL[symbol], int(operand)))
    return first, steps


class CalcEpisodeExpert(EpisodeExpert):
    """Works through the operations in order; the running value comes from the tool results."""

    def __init__(self, prompt: str, error_rate: float, rng: random.Random) -> None:
        self.value, self.steps = parse_expression(prompt)
        self.error_rate, self.rng = error_rate, rng
        self.done_steps = 0

    def observe(self, results: Sequence[ToolResult], observation: str) -> None:
        if results and not results[-1].error:
            self.value = int(results[-1].content)

    def turn(self) -> ExpertTurn:
        if self.done_steps == len(self.steps):
            return ExpertTurn(content=str(self.value))
        tool, operand = self.steps[self.done_steps]
        self.done_steps += 1
        if self.rng.random() < self.error_rate:
            tool, operand = self._slip(tool, operand)
        return ExpertTurn(calls=(SftCall(tool, {"a": self.value, "b": operand}),))

    def _slip(self, tool: str, operand: int) -> tuple[str, int]:
        """A plausible mistake: a wrong operation for a division, else an operand off by 1-3."""
        if tool == "divide":
            return "multiply", operand
        return tool, operand + self.rng.choice((-1, 1)) * self.rng.randint(1, 3)


class CalcExpert(Expert):
    """Demonstrations for `calc`."""

    env = ENV_NAME

    def begin(self, task: Task, opening: Opening, rng: random.Random) -> EpisodeExpert:
        return CalcEpisodeExpert(task.prompt, self.error_rate, rng)
