"""Rubric of the `calc` tool environment: a right answer, reached with valid tool calls,
briefly.

- exact_match (0.8): env_info answer_correct (or the final text against spec expected);
- tool_calls (0.1): share of well-formed tool calls;
- length (0.05): 1 up to 512 generated tokens, 0 at 1024;
- turns (0.05): 1 up to 4 turns, -0.1 per turn beyond;
- env_ok (0): an env error that ended the episode, shown in the breakdown, not rewarded.
"""

from __future__ import annotations

from libs.reward.criteria import (
    env_ok,
    exact_match,
    length_penalty,
    tool_call_validity,
    turn_penalty,
)
from libs.reward.rubric import Criterion, Rubric


def calc_rubric() -> Rubric:
    return Rubric(
        [
            Criterion("exact_match", 0.8, exact_match),
            Criterion("tool_calls", 0.1, tool_call_validity),
            Criterion("length", 0.05, length_penalty(budget_tokens=512, ramp_tokens=512)),
            Criterion("turns", 0.05, turn_penalty(free_turns=4, penalty_per_turn=0.1)),
            Criterion("env_ok", 0.0, env_ok),
        ],
        correct_criterion="exact_match",
    )
