"""Verifiable criteria: pure functions of (rollout, task) -> (score in [0, 1], reason).

They read only what the environment and the harness wrote on the rollout, never the policy's
claims: `env_info` (the coding env's `tests_passed`/`tests_total`, a tool env's
`answer_correct`/`expected`), `stats` (EPISODE_STAT_*), `env_error`, and the task's spec.
Parametrised ones (`length_penalty`, `turn_penalty`) are factories returning the function.

An episode that an env error ended shows in the breakdown twice: `env_ok` scores it 0 with
the error kind and text, and the checks it prevented (no test results) say so in their reason.
"""

from __future__ import annotations

import math

from libs.reward.rubric import Criterion, CriterionFn, final_assistant_text
from proto.messages import (
    EPISODE_STAT_GENERATED_TOKENS,
    EPISODE_STAT_INVALID_TOOL_CALLS,
    EPISODE_STAT_TOOL_CALLS,
    EPISODE_STAT_TURNS,
    Rollout,
    Task,
)


def env_ok(rollout: Rollout, task: Task) -> tuple[float, str]:
    """1 unless an environment error ended the episode (0, naming the error)."""
    if rollout.finish_reason == "env_error" or rollout.env_error:
        kind = rollout.env_error or "unknown"
        return 0.0, f"episode ended by env error {kind}: {rollout.env_error_message[:200]}"
    return 1.0, f"no env error (finish {rollout.finish_reason})"


def tests_passed(rollout: Rollout, task: Task) -> tuple[float, str]:
    """Fraction of the hidden tests that passed (env_info tests_passed / tests_total).

    No results: 0 when the episode did not end normally (env error, length, turns, timeout:
    the tests never ran), an error when it did (the env should have reported them).
    """
    passed, total = rollout.env_info.get("tests_passed"), rollout.env_info.get("tests_total")
    if passed is None or total is None:
        if rollout.finish_reason != "stop":
            return 0.0, f"no test results: episode ended by {_ending(rollout)}"
        raise ValueError("env_info has no tests_passed/tests_total for a finished episode")
    passed, total = int(passed), int(total)
    if total <= 0 or not 0 <= passed <= total:
        raise ValueError(f"env_info tests_passed={passed} tests_total={total} is not a fraction")
    return passed / total, f"{passed}/{total} tests passed"


def exact_match(rollout: Rollout, task: Task) -> tuple[float, str]:
    """1 when the answer is right: the env's verdict (env_info answer_correct) when it gave
    one, else the final assistant text against task.spec's `expected` (or `answer`)."""
    if "answer_correct" in rollout.env_info:
        expected = rollout.env_info.get("expected", task.spec.get("expected", "?"))
        if rollout.env_info["answer_correct"]:
            return 1.0, f"env: answer correct (expected {expected!r})"
        return 0.0, f"env: answer wrong, expected {expected!r}"
    if "expected" not in task.spec and "answer" not in task.spec:
        if rollout.finish_reason != "stop":
            return 0.0, f"no answer checked: episode ended by {_ending(rollout)}"
        raise ValueError("neither env_info answer_correct nor task.spec expected/answer is set")
    expected = str(task.spec.get("expected", task.spec.get("answer")))
    answer = final_assistant_text(rollout)
    if normalized(answer) == normalized(expected):
        return 1.0, f"answer matches {expected!r}"
    return 0.0, f"answer {answer[-80:]!r}, expected {expected!r}"


def normalized(text: str) -> str:
    """Case- and whitespace-insensitive form of an answer."""
    return " ".join(text.split()).casefold()


def tool_call_validity(rollout: Rollout, task: Task) -> tuple[float, str]:
    """1 - invalid / (valid + invalid) tool calls; 1 when the policy made none."""
    valid = int(rollout.stats.get(EPISODE_STAT_TOOL_CALLS, 0))
    invalid = int(rollout.stats.get(EPISODE_STAT_INVALID_TOOL_CALLS, 0))
    if valid + invalid == 0:
        return 1.0, "no tool calls"
    return 1.0 - invalid / (valid + invalid), f"{invalid} of {valid + invalid} tool calls invalid"


def length_penalty(budget_tokens: int, ramp_tokens: int) -> CriterionFn:
    """1 up to `budget_tokens` generated tokens, falling linearly to 0 at budget + ramp."""
    if budget_tokens < 0 or ramp_tokens <= 0:
        raise ValueError(
            f"length_penalty needs budget >= 0, ramp > 0; got {budget_tokens}, {ramp_tokens}"
        )

    def length(rollout: Rollout, task: Task) -> tuple[float, str]:
        tokens = generated_tokens(rollout)
        over = max(0, tokens - budget_tokens)
        score = max(0.0, 1.0 - over / ramp_tokens)
        return score, f"{tokens} generated tokens, budget {budget_tokens} (+{ramp_tokens} ramp)"

    return length


def turn_penalty(free_turns: int, penalty_per_turn: float) -> CriterionFn:
    """1 up to `free_turns` assistant turns, minus `penalty_per_turn` per turn beyond (>= 0)."""
    if free_turns < 0 or not 0 < penalty_per_turn <= 1 or math.isnan(penalty_per_turn):
        raise ValueError(
            f"turn_penalty needs free_turns >= 0, 0 < penalty <= 1; got {free_turns}, "
            f"{penalty_per_turn}"
        )

    def turns(rollout: Rollout, task: Task) -> tuple[float, str]:
        num = num_turns(rollout)
        score = max(0.0, 1.0 - penalty_per_turn * max(0, num - free_turns))
        return score, f"{num} turns, {free_turns} free, -{penalty_per_turn} per extra turn"

    return turns


def tool_use_criteria(
    *, budget_tokens: int, free_turns: int, penalty_per_turn: float
) -> list[Criterion]:
    """What a tool environment's rubric adds to its correctness criterion: tool_calls (0.1,
    share of well-formed calls), length (0.05, 1 up to `budget_tokens` generated tokens, 0 at
    twice that), turns (0.05, `turn_penalty`) and env_ok (0: shown in the breakdown, not
    rewarded)."""
    return [
        Criterion("tool_calls", 0.1, tool_call_validity),
        Criterion("length", 0.05, length_penalty(budget_tokens, ramp_tokens=budget_tokens)),
        Criterion("turns", 0.05, turn_penalty(free_turns, penalty_per_turn)),
        Criterion("env_ok", 0.0, env_ok),
    ]


def generated_tokens(rollout: Rollout) -> int:
    """Tokens the policy generated: the harness's count, else the assistant turns' tokens."""
    if EPISODE_STAT_GENERATED_TOKENS in rollout.stats:
        return int(rollout.stats[EPISODE_STAT_GENERATED_TOKENS])
    return sum(len(t.token_ids) for t in rollout.turns if t.role == "assistant")


def num_turns(rollout: Rollout) -> int:
    """Assistant turns: the harness's count, else counted on the rollout."""
    if EPISODE_STAT_TURNS in rollout.stats:
        return int(rollout.stats[EPISODE_STAT_TURNS])
    return sum(1 for t in rollout.turns if t.role == "assistant")


def _ending(rollout: Rollout) -> str:
    if rollout.finish_reason == "env_error":
        return f"env error {rollout.env_error or 'unknown'}"
    return rollout.finish_reason
