"""Rubric of the `coding` environment: hidden tests pass, through valid tool calls, without
wandering: tests_passed (0.8: the fraction of hidden tests passed, env_info
tests_passed/tests_total), then the tool-use criteria (libs.reward.criteria.tool_use_criteria)
with a budget of 4096 generated tokens and 16 free turns, -0.05 per turn beyond.
"""

from __future__ import annotations

from libs.reward.criteria import tests_passed, tool_use_criteria
from libs.reward.rubric import Criterion, Rubric


def coding_rubric() -> Rubric:
    tool_use = tool_use_criteria(budget_tokens=4096, free_turns=16, penalty_per_turn=0.05)
    return Rubric(
        [Criterion("tests_passed", 0.8, tests_passed), *tool_use],
        correct_criterion="tests_passed",
    )
