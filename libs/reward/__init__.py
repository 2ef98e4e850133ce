"""Rewards: rubrics of weighted criteria, and the rubric of each environment by name.

- `rubric`: composition (per-sample criteria, criterion sets, group criteria), scoring;
- `criteria`: verifiable checks; `group_criteria`: checks comparing the samples of a group;
- `judge`: LLM judges behind an OpenAI-compatible endpoint;
- `group_gate`: holding a group's rollouts until the whole group can be scored;
- `arith`, `calc`, `coding`, `recall`, `dataset`: the rubric of each built-in environment.
"""

from collections.abc import Callable

from libs.envs.arithmetic import ENV_NAME as ARITH
from libs.reward.arith import arith_rubric
from libs.reward.calc import ENV_NAME as CALC
from libs.reward.calc import calc_rubric
from libs.reward.coding import ENV_NAME as CODING
from libs.reward.coding import coding_rubric
from libs.reward.dataset import ENV_NAME as DATASET
from libs.reward.dataset import dataset_rubric
from libs.reward.recall import ENV_NAME as RECALL
from libs.reward.recall import recall_rubric
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

_RUBRICS: dict[str, Callable[[], Rubric]] = {
    ARITH: arith_rubric,
    CALC: calc_rubric,
    CODING: coding_rubric,
    DATASET: dataset_rubric,
    RECALL: recall_rubric,
}


class UnknownRubricError(KeyError):
    """No rubric is registered for this environment."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no rubric for this environment"


def register_rubric(env: str, factory: Callable[[], Rubric]) -> None:
    """Score rollouts of environment `env` with the rubric `factory` builds."""
    _RUBRICS[env] = factory


def rubric_for(env: str) -> Rubric:
    """The rubric of environment `env`; UnknownRubricError names the known ones."""
    try:
        return _RUBRICS[env]()
    except KeyError:
        raise UnknownRubricError(
            f"no rubric for environment {env!r}; known: {', '.join(sorted(_RUBRICS))}"
        ) from None


__all__ = [
    "Criterion",
    "CriterionError",
    "CriterionSet",
    "GroupCriterion",
    "GroupSample",
    "Rubric",
    "RubricScore",
    "UnknownRubricError",
    "register_rubric",
    "rubric_for",
    "score_group",
    "score_rollout",
]
