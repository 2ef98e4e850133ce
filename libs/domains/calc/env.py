"""The built-in multi-turn tool environment: multi-step integer arithmetic with calculator tools.

A task asks for the value of an expression such as `((12 + 7) * 3) - 5`; the policy may call
`add`, `subtract`, `multiply` and `divide` (each takes integers `a` and `b`) as often as it
likes, then answers with the number in a turn without tool calls, which ends the episode with
`info = {"answer_correct": bool, "expected": int, "answer": str, "num_tool_calls": int}`.
Difficulty d means d + 1 operations. Tools run in-process: a bad call gets a ToolResult with
an error kind (proto.messages.TOOL_ERROR_*), never an exception.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from libs.envs.base import (
    Environment,
    Episode,
    Opening,
    SeededTaskSource,
    StepResult,
    TaskSource,
)
from proto.messages import (
    TOOL_ERROR_BAD_ARGUMENTS,
    TOOL_ERROR_FAILED,
    TOOL_ERROR_UNKNOWN_TOOL,
    ChatMessage,
    Task,
    ToolCall,
    ToolResult,
    ToolSpec,
)

ENV_NAME = "calc"
MAX_DIFFICULTY = 7
MAX_OPERAND = 99
MAX_ABS_INT = 10**18  # tool operands and results beyond this are refused (bad_arguments)
_INTEGER = re.compile(r"-?\d[\d,]*")

_OPERAND_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _divide(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("division by zero")
    if a % b:
        raise ArithmeticError(f"{a} is not divisible by {b}: divide works on exact quotients")
    return a // b


OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("+", lambda a, b: a + b),
    "subtract": ("-", lambda a, b: a - b),
    "multiply": ("*", lambda a, b: a * b),
    "divide": ("/", _divide),
}

TOOLS: tuple[ToolSpec, ...] = tuple(
    ToolSpec(
        name=name,
        description=f"Returns a {symbol} b" + (" (b must divide a)." if name == "divide" else "."),
        parameters=_OPERAND_SCHEMA,
    )
    for name, (symbol, _) in OPERATIONS.items()
)

# Short on purpose: every byte of the opening is prefilled and trained on in every episode.
SYSTEM_PROMPT = (
    "Work out the expression with the tools, one operation per call, then answer with the "
    "number only."
)


def make_problem(rng: random.Random, num_ops: int) -> tuple[str, int]:
    """(expression, value) of `num_ops` operations on operands in [2, 99], folded left;
    every division is exact."""
    value = rng.randint(2, MAX_OPERAND)
    expression = str(value)
    for step in range(num_ops):
        op = rng.choice(("add", "subtract", "multiply", "divide"))
        divisors = [d for d in range(2, MAX_OPERAND + 1) if value % d == 0 and d != abs(value)]
        if op == "divide" and not divisors:
            op = "multiply"
        operand = rng.choice(divisors) if op == "divide" else rng.randint(2, MAX_OPERAND)
        symbol, apply = OPERATIONS[op]
        value = apply(value, operand)
        expression = f"{expression} {symbol} {operand}"
        if step < num_ops - 1:
            expression = f"({expression})"
    return expression, value


def parse_answer(text: str) -> str:
    """The last integer written in `text` ("so it is 1,234." -> "1234"), or ""."""
    found = _INTEGER.findall(text)
    return found[-1].replace(",", "") if found else ""


class CalcTasks(SeededTaskSource):
    """Calculator tasks; task `i` is drawn from its own seeded generator (order-independent)."""

    env: ClassVar[str] = ENV_NAME
    max_difficulty: ClassVar[int] = MAX_DIFFICULTY

    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        expression, value = make_problem(self.rng(index), self.difficulty + 1)
        return f"What is {expression}?", {"answer": value, "num_ops": self.difficulty + 1}


def call_tool(call: ToolCall) -> ToolResult:
    """Run one calculator call; every failure is a ToolResult with an error kind."""

    def result(content: str, error: str = "") -> ToolResult:
        return ToolResult(call_id=call.call_id, name=call.name, content=content, error=error)

    if call.name not in OPERATIONS:
        offered = ", ".join(OPERATIONS)
        return result(f"unknown tool {call.name!r}; tools: {offered}", TOOL_ERROR_UNKNOWN_TOOL)
    problem = _check_operands(call.arguments)
    if problem:
        return result(problem, TOOL_ERROR_BAD_ARGUMENTS)
    a, b = call.arguments["a"], call.arguments["b"]
    try:
        value = OPERATIONS[call.name][1](a, b)
    except ArithmeticError as exc:  # ZeroDivisionError included
        return result(str(exc), TOOL_ERROR_FAILED)
    if abs(value) > MAX_ABS_INT:
        return result("the result has more than 18 digits", TOOL_ERROR_FAILED)
    return result(str(value))


def _check_operands(arguments: dict[str, Any]) -> str:
    """Why `arguments` are not {"a": int, "b": int}, or ""."""
    if set(arguments) != {"a", "b"}:
        return f'arguments must be exactly {{"a": <integer>, "b": <integer>}}, got {arguments!r}'
    for key in ("a", "b"):
        value = arguments[key]
        if type(value) is not int:  # bool is an int subclass: refused too
            return f"{key!r} must be an integer, got {value!r}"
        if abs(value) > MAX_ABS_INT:
            return f"{key!r} has more than 18 digits"
    return ""


class CalcEpisode(Episode):
    """Tool calls until a turn without any; that turn's last integer is the answer."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.num_tool_calls = 0

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        if tool_calls:
            self.num_tool_calls += len(tool_calls)
            return StepResult(tool_results=tuple(call_tool(call) for call in tool_calls))
        answer = parse_answer(action)
        info = {
            "answer_correct": answer == str(self.expected),
            "expected": self.expected,
            "answer": answer,
            "num_tool_calls": self.num_tool_calls,
        }
        return StepResult(done=True, info=info)


class CalcEnv(Environment):
    """Serves calculator tasks as chat episodes with four arithmetic tools."""

    name: ClassVar[str] = ENV_NAME

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        expected = task.spec.get("answer")
        if type(expected) is not int:
            raise ValueError(f"calc task {task.task_id} has no integer answer in spec['answer']")
        num_ops = int(task.spec.get("num_ops", MAX_DIFFICULTY + 1))
        opening = Opening(
            messages=(
                ChatMessage(role="system", content=SYSTEM_PROMPT),
                ChatMessage(role="user", content=task.prompt),
            ),
            tools=TOOLS,
            max_turns=num_ops + 3,
            max_tokens=256,
        )
        return CalcEpisode(expected), opening

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return CalcTasks(difficulty=difficulty, group_size=group_size, seed=seed)
