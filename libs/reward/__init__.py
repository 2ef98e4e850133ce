"""Rewards: rubrics of weighted criteria.

- `rubric`: composition (per-sample criteria, criterion sets, group criteria), scoring;
- `criteria`: verifiable checks; `group_criteria`: checks comparing the samples of a group;
- `judge`: LLM judges behind an OpenAI-compatible endpoint;
- `group_gate`: holding a group's rollouts until the whole group can be scored.

Each domain's rubric lives in its folder (libs/domains/<name>/rubric.py), looked up with
libs.domains.registry.rubric_for.
"""

from libs.reward.rubric import (
    Criterion,
    CriterionError,
    CriterionSet,
    GroupCriterion,
    GroupSample,
    Rubric,
    RubricScore,
    score_group,
    score_rollout,
)

__all__ = [
    "Criterion",
    "CriterionError",
    "CriterionSet",
    "GroupCriterion",
    "GroupSample",
    "Rubric",
    "RubricScore",
    "score_group",
    "score_rollout",
]
