"""Group criteria: score every sample of a GRPO group (same task) by comparing the samples.

    GroupCriterion("shortest_correct", 0.1, shortest_correct("exact_match"))

`shortest_correct(name)`: a correct sample (criterion `name` scored 1) gets
shortest / its own length in generated tokens, so the shortest correct answer gets 1 and one
twice as long 0.5; a wrong sample gets 0. A partial group says so in every reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.reward.criteria import generated_tokens
from libs.reward.rubric import GroupCriterionFn, GroupSample
from proto.messages import Task


def shortest_correct(correct_criterion: str) -> GroupCriterionFn:
    """The shortest-correct-answer bonus over criterion `correct_criterion`."""

    def shortest(samples: Sequence[GroupSample], task: Task, note: str) -> list[tuple[float, str]]:
        lengths = [max(1, generated_tokens(s.rollout)) for s in samples]
        correct = [_is_correct(s, correct_criterion) for s in samples]
        suffix = f" ({note})" if note else ""
        if not any(correct):
            return [(0.0, f"no correct sample in the group{suffix}")] * len(samples)
        best = min(n for n, ok in zip(lengths, correct, strict=True) if ok)
        return [
            (best / n, f"correct in {n} tokens; shortest correct {best}{suffix}")
            if ok
            else (0.0, f"not correct; shortest correct {best} tokens{suffix}")
            for n, ok in zip(lengths, correct, strict=True)
        ]

    return shortest


def _is_correct(sample: GroupSample, criterion: str) -> bool:
    if criterion not in sample.criteria:
        raise ValueError(f"shortest_correct needs criterion {criterion!r} in the rubric")
    return sample.criteria[criterion].score >= 1.0
