"""Rubrics: named, weighted criteria composed into one reward with its breakdown.

A rubric holds three kinds of criteria, each scoring in [0, 1] with a reason:

- `Criterion`: a pure function of (rollout, task), e.g. exact match (libs.reward.criteria);
- `CriterionSet`: several criteria scored together by one awaitable call, e.g. an LLM judge
  asked about a group of criteria in one request (libs.reward.judge);
- `GroupCriterion`: scores every sample of a GRPO group (same group_id) at once, seeing the
  others and their per-sample scores, e.g. a bonus for the shortest correct answer.

The reward is the weighted mean: sum(w * s) / sum(w). The breakdown keeps every criterion's
score, weight and reason (proto.messages.CriterionScore), so a reward can always be explained.
A criterion that cannot score marks the rollout unscored with the reason: never a silent 0.

    scored = await score_rollout(rubric, rollout, task, now=time.time())
    group = await score_group(rubric, rollouts, task, now=time.time())   # group criteria
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from proto.messages import CriterionScore, Rollout, ScoredRollout, Task

CriterionFn = Callable[[Rollout, Task], tuple[float, str]]


@dataclass(frozen=True)
class Criterion:
    """One named check with its weight (>= 0) in the rubric."""

    name: str
    weight: float
    fn: CriterionFn


class CriterionSet(abc.ABC):
    """Criteria scored together by one awaitable call (e.g. one judge request)."""

    @property
    @abc.abstractmethod
    def weights(self) -> dict[str, float]:
        """Name -> weight of each criterion of the set, in breakdown order."""

    @abc.abstractmethod
    async def score(self, rollout: Rollout, task: Task) -> dict[str, tuple[float, str]]:
        """Name -> (score, reason) for every criterion; raises when it cannot score."""


@dataclass(frozen=True)
class GroupSample:
    """One sample of a group as group criteria see it: the rollout and its per-sample scores."""

    rollout: Rollout
    criteria: dict[str, CriterionScore]


# (samples of the group, task, note) -> one (score, reason) per sample, in order. The note is
# "" for a complete group, else why it is partial; a group criterion puts it in its reasons.
GroupCriterionFn = Callable[
    [Sequence[GroupSample], Task, str],
    list[tuple[float, str]] | Awaitable[list[tuple[float, str]]],
]


@dataclass(frozen=True)
class GroupCriterion:
    """A criterion that scores all samples of a group at once (plain or async function)."""

    name: str
    weight: float
    fn: GroupCriterionFn


@dataclass(frozen=True)
class RubricScore:
    """The composed reward and the per-criterion breakdown."""

    reward: float
    criteria: list[CriterionScore]


class CriterionError(RuntimeError):
    """A criterion could not score a rollout (it raised, or gave a score outside [0, 1])."""


class Rubric:
    """Weighted criteria: per-sample ones, sets scored in one call, and group ones."""

    def __init__(
        self,
        criteria: Sequence[Criterion],
        sets: Sequence[CriterionSet] = (),
        group: Sequence[GroupCriterion] = (),
        correct_criterion: str | None = None,
    ) -> None:
        weights = [(c.name, c.weight) for c in criteria]
        weights += [item for s in sets for item in s.weights.items()]
        weights += [(c.name, c.weight) for c in group]
        names = [name for name, _ in weights]
        if len(set(names)) != len(names):
            raise ValueError(f"criterion names must be unique, got {names}")
        if any(w < 0 for _, w in weights):
            raise ValueError(f"criterion weights must be >= 0, got {dict(weights)}")
        if sum(w for _, w in weights) <= 0:
            raise ValueError("a rubric needs at least one criterion with a positive weight")
        self.criteria = tuple(criteria)
        self.sets = tuple(sets)
        self.group = tuple(group)
        # The criterion that says "this answer is right" (1.0), for group criteria such as
        # the shortest-correct bonus.
        self.correct_criterion = correct_criterion

    def extended(
        self, sets: Sequence[CriterionSet] = (), group: Sequence[GroupCriterion] = ()
    ) -> Rubric:
        """This rubric with more criterion sets (e.g. judges) and group criteria."""
        return Rubric(
            self.criteria, (*self.sets, *sets), (*self.group, *group), self.correct_criterion
        )

    @property
    def needs_group(self) -> bool:
        """True when scoring must wait for the whole group of a task."""
        return bool(self.group)

    async def score(self, rollout: Rollout, task: Task) -> RubricScore:
        """Score every per-sample criterion; CriterionError names the one that failed."""
        scores = [self._score_one(criterion, rollout, task) for criterion in self.criteria]
        results = await asyncio.gather(
            *(self._score_set(s, rollout, task) for s in self.sets), return_exceptions=True
        )
        for result in results:  # every set ran to its end; the first failure is reported
            if isinstance(result, BaseException):
                raise result
            scores += result
        return _composed(scores)

    @staticmethod
    def _score_one(criterion: Criterion, rollout: Rollout, task: Task) -> CriterionScore:
        try:
            score, reason = criterion.fn(rollout, task)
        except Exception as exc:
            raise CriterionError(f"criterion {criterion.name!r} raised {exc!r}") from exc
        return _checked(criterion.name, criterion.weight, score, reason)

    @staticmethod
    async def _score_set(
        criterion_set: CriterionSet, rollout: Rollout, task: Task
    ) -> list[CriterionScore]:
        names = ", ".join(criterion_set.weights)
        try:
            results = await criterion_set.score(rollout, task)
        except Exception as exc:
            raise CriterionError(f"criteria {names} could not be scored: {exc}") from exc
        missing = set(criterion_set.weights) - set(results)
        if missing:
            raise CriterionError(f"criteria {sorted(missing)} got no score")
        return [
            _checked(name, weight, *results[name]) for name, weight in criterion_set.weights.items()
        ]

    async def score_group_criteria(
        self, samples: Sequence[GroupSample], task: Task, note: str = ""
    ) -> list[list[CriterionScore]]:
        """Every group criterion's score of every sample: one list per sample, in order."""
        per_sample: list[list[CriterionScore]] = [[] for _ in samples]
        for criterion in self.group:
            try:
                results = criterion.fn(samples, task, note)
                if inspect.isawaitable(results):
                    results = await results
            except Exception as exc:
                raise CriterionError(f"group criterion {criterion.name!r} raised {exc!r}") from exc
            if len(results) != len(samples):
                raise CriterionError(
                    f"group criterion {criterion.name!r} scored {len(results)} of "
                    f"{len(samples)} samples"
                )
            for scores, (score, reason) in zip(per_sample, results, strict=True):
                scores.append(_checked(criterion.name, criterion.weight, score, reason))
        return per_sample


def _checked(name: str, weight: float, score: float, reason: str) -> CriterionScore:
    if not 0.0 <= score <= 1.0:
        raise CriterionError(f"criterion {name!r} scored {score}, outside [0, 1]")
    return CriterionScore(name=name, weight=weight, score=float(score), reason=reason)


def _composed(scores: list[CriterionScore]) -> RubricScore:
    total_weight = sum(s.weight for s in scores)
    reward = sum(s.weight * s.score for s in scores) / total_weight
    return RubricScore(reward=reward, criteria=scores)


def final_assistant_text(rollout: Rollout) -> str:
    """Text of the last assistant turn ("" when the policy said nothing)."""
    for turn in reversed(rollout.turns):
        if turn.role == "assistant":
            return turn.text
    return ""


def unscored(rollout: Rollout, reason: str, now: float) -> ScoredRollout:
    """A rollout that could not be scored: reward 0 but `scored=False`, so no one trains on
    it as if it had earned 0."""
    return ScoredRollout(
        rollout=rollout, reward=0.0, scored=False, unscored_reason=reason, scored_at=now
    )


async def score_rollout(rubric: Rubric, rollout: Rollout, task: Task, now: float) -> ScoredRollout:
    """The scored rollout (per-sample criteria only); a criterion that fails marks it
    unscored with the reason, never a silent zero reward."""
    try:
        result = await rubric.score(rollout, task)
    except CriterionError as exc:
        return unscored(rollout, str(exc), now)
    return ScoredRollout(
        rollout=rollout, reward=result.reward, criteria=result.criteria, scored_at=now
    )


async def score_group(
    rubric: Rubric, rollouts: Sequence[Rollout], task: Task, now: float, note: str = ""
) -> list[ScoredRollout]:
    """Score the samples of one group: per-sample criteria, then the group criteria over the
    samples that scored. `note` says why the group is partial ("" when complete). A group
    criterion that fails marks every sample of the group unscored with the reason."""
    singles = await asyncio.gather(*(_score_or_error(rubric, r, task) for r in rollouts))
    ok = [(r, s) for r, s in zip(rollouts, singles, strict=True) if isinstance(s, RubricScore)]
    samples = [GroupSample(r, {c.name: c for c in s.criteria}) for r, s in ok]
    try:
        group_scores = await rubric.score_group_criteria(samples, task, note) if samples else []
    except CriterionError as exc:
        return [unscored(r, str(exc), now) for r in rollouts]
    by_id = {
        r.rollout_id: _composed([*s.criteria, *extra])
        for (r, s), extra in zip(ok, group_scores, strict=True)
    }
    out = []
    for rollout, single in zip(rollouts, singles, strict=True):
        result = by_id.get(rollout.rollout_id)
        if result is None:
            out.append(unscored(rollout, str(single), now))
            continue
        out.append(
            ScoredRollout(
                rollout=rollout, reward=result.reward, criteria=result.criteria, scored_at=now
            )
        )
    return out


async def _score_or_error(rubric: Rubric, rollout: Rollout, task: Task) -> RubricScore | str:
    try:
        return await rubric.score(rollout, task)
    except CriterionError as exc:
        return str(exc)
