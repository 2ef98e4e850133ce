"""Rewards: rubrics of weighted criteria, and the rubric of each environment by name."""

from collections.abc import Callable

from libs.envs.arithmetic import ENV_NAME as ARITH
from libs.reward.arith import arith_rubric
from libs.reward.rubric import Criterion, CriterionError, Rubric, RubricScore, score_rollout

_RUBRICS: dict[str, Callable[[], Rubric]] = {ARITH: arith_rubric}


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
    "Rubric",
    "RubricScore",
    "UnknownRubricError",
    "register_rubric",
    "rubric_for",
    "score_rollout",
]
