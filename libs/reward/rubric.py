"""Rubrics: named, weighted criteria composed into one reward with its breakdown.

A criterion maps (rollout, task) to a score in [0, 1] and a reason. The reward is the
weighted mean: sum(w * s) / sum(w). The breakdown keeps every criterion's score, weight and
reason (proto.messages.CriterionScore), so a reward can always be explained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proto.messages import CriterionScore, Rollout, ScoredRollout, Task

CriterionFn = Callable[[Rollout, Task], tuple[float, str]]


@dataclass(frozen=True)
class Criterion:
    """One named check with its weight (>= 0) in the rubric."""

    name: str
    weight: float
    fn: CriterionFn


@dataclass(frozen=True)
class RubricScore:
    """The composed reward and the per-criterion breakdown."""

    reward: float
    criteria: list[CriterionScore]


class CriterionError(RuntimeError):
    """A criterion could not score a rollout (it raised, or gave a score outside [0, 1])."""


class Rubric:
    """A list of weighted criteria."""

    def __init__(self, criteria: Sequence[Criterion]) -> None:
        names = [c.name for c in criteria]
        if len(set(names)) != len(names):
            raise ValueError(f"criterion names must be unique, got {names}")
        if any(c.weight < 0 for c in criteria):
            raise ValueError(f"criterion weights must be >= 0, got {[c.weight for c in criteria]}")
        if sum(c.weight for c in criteria) <= 0:
            raise ValueError("a rubric needs at least one criterion with a positive weight")
        self.criteria = tuple(criteria)

    def score(self, rollout: Rollout, task: Task) -> RubricScore:
        """Score every criterion; CriterionError names the one that failed."""
        scores = [self._score_one(criterion, rollout, task) for criterion in self.criteria]
        total_weight = sum(s.weight for s in scores)
        reward = sum(s.weight * s.score for s in scores) / total_weight
        return RubricScore(reward=reward, criteria=scores)

    @staticmethod
    def _score_one(criterion: Criterion, rollout: Rollout, task: Task) -> CriterionScore:
        try:
            score, reason = criterion.fn(rollout, task)
        except Exception as exc:
            raise CriterionError(f"criterion {criterion.name!r} raised {exc!r}") from exc
        if not 0.0 <= score <= 1.0:
            raise CriterionError(f"criterion {criterion.name!r} scored {score}, outside [0, 1]")
        return CriterionScore(
            name=criterion.name, weight=criterion.weight, score=float(score), reason=reason
        )


def final_assistant_text(rollout: Rollout) -> str:
    """Text of the last assistant turn ("" when the policy said nothing)."""
    for turn in reversed(rollout.turns):
        if turn.role == "assistant":
            return turn.text
    return ""


def score_rollout(rubric: Rubric, rollout: Rollout, task: Task, now: float) -> ScoredRollout:
    """The scored rollout; a criterion that fails marks it unscored with the reason, never
    a silent zero reward."""
    try:
        result = rubric.score(rollout, task)
    except CriterionError as exc:
        return ScoredRollout(
            rollout=rollout, reward=0.0, scored=False, unscored_reason=str(exc), scored_at=now
        )
    return ScoredRollout(
        rollout=rollout, reward=result.reward, criteria=result.criteria, scored_at=now
    )
