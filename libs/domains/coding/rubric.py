"""Rubric of the `coding` environment: hidden tests pass, through valid tool calls, without
wandering.

- tests_passed (0.8): fraction of hidden tests passed (env_info tests_passed/tests_total);
- tool_calls (0.1): share of well-formed tool calls;
- length (0.05): 1 up to 4096 generated tokens, 0 at 8192;
- turns (0.05): 1 up to 16 turns, -0.05 per turn beyond;
- env_ok (0): an env error that ended the episode, shown in the breakdown, not rewarded.
"""

from __future__ import annotations

from libs.reward.criteria import (
    env_ok,
    length_penalty,
    tests_passed,
    tool_call_validity,
    turn_penalty,
)
from libs.reward.rubric import Criterion, Rubric


def coding_rubric() -> Rubric:
    return Rubric(
        [
            Criterion("tests_passed", 0.8, tests_passed),
            Criterion("tool_calls", 0.1, tool_call_validity),
            Criterion("length", 0.05, length_penalty(budget_tokens=4096, ramp_tokens=4096)),
            Criterion("turns", 0.05, turn_penalty(free_turns=16, penalty_per_turn=0.05)),
            Criterion("env_ok", 0.0, env_ok),
        ],
        correct_criterion="tests_passed",
    )
