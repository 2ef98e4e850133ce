"""Rubric of the `calc` tool environment: a right answer, reached with valid tool calls,
briefly: exact_match (0.8: env_info answer_correct, or the final text against spec expected),
then the tool-use criteria (libs.reward.criteria.tool_use_criteria) with a budget of 512
generated tokens and 4 free turns, -0.1 per turn beyond.
"""

from __future__ import annotations

from libs.reward.criteria import exact_match, tool_use_criteria
from libs.reward.rubric import Criterion, Rubric


def calc_rubric() -> Rubric:
    tool_use = tool_use_criteria(budget_tokens=512, free_turns=4, penalty_per_turn=0.1)
    return Rubric(
        [Criterion("exact_match", 0.8, exact_match), *tool_use], correct_criterion="exact_match"
    )
