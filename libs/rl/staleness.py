"""Staleness: how many policy versions behind the trainer a sample was generated.

    split = split_by_staleness(scored, trainer_version=7, max_staleness=2)
    split.kept, split.dropped          # versions 5..7 kept; older (and newer) dropped
    staleness_histogram(split.staleness)   # {0: 12, 1: 30, 2: 6, 4: 3}

Weights can change mid-episode, so each assistant turn carries the version that generated
it, and the bound is checked per turn: a sample is kept while its NEWEST assistant turn is
within the bound (its staleness is that turn's), and its turns past the bound stay in the
sequence as context without being trained on (`turn_trainable`, read by
libs.rl.batch.build_batch). So a long episode that a worker carried on with newer weights
is not thrown away for its first turns. `max_staleness = 0` trains only on turns of the
trainer's current version (the synchronous baseline).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from proto.messages import Rollout, ScoredRollout

SampleT = TypeVar("SampleT", Rollout, ScoredRollout)


def sample_policy_version(sample: Rollout | ScoredRollout) -> int:
    """The oldest policy version among the sample's assistant turns.

    Raises ValueError, naming the rollout, when it has no assistant turn or an assistant
    turn without a version: such a sample cannot be placed relative to the trainer.
    """
    rollout = sample.rollout if isinstance(sample, ScoredRollout) else sample
    versions = [turn.policy_version for turn in rollout.turns if turn.role == "assistant"]
    if not versions:
        raise ValueError(f"rollout {rollout.rollout_id!r} has no assistant turn to train on")
    if any(version is None for version in versions):
        raise ValueError(
            f"rollout {rollout.rollout_id!r} has an assistant turn without policy_version; "
            "the engine must record the version of every turn it generates"
        )
    return min(version for version in versions if version is not None)


def newest_policy_version(sample: Rollout | ScoredRollout) -> int:
    """The newest policy version among the sample's assistant turns (ValueError as
    `sample_policy_version`)."""
    sample_policy_version(sample)  # the same checks
    rollout = sample.rollout if isinstance(sample, ScoredRollout) else sample
    return max(t.policy_version for t in rollout.turns if t.policy_version is not None)


def sample_staleness(
    sample: Rollout | ScoredRollout,
    trainer_version: int,
    equivalent: Callable[[int], int] | None = None,
) -> int:
    """trainer_version - the version of the sample's newest turn; negative for a sample from
    the future. `equivalent` maps a version to the one on the trainer's own line as far from
    its weights (libs.trainer.lineage: after a resume); none counts versions plainly."""
    version = newest_policy_version(sample)
    return trainer_version - (equivalent(version) if equivalent is not None else version)


def turn_trainable(
    trainer_version: int, max_staleness: int, equivalent: Callable[[int], int] | None = None
) -> Callable[[int], bool]:
    """Whether an assistant turn of a given version is within the bound (else: context)."""

    def trainable(version: int) -> bool:
        mapped = equivalent(version) if equivalent is not None else version
        return 0 <= trainer_version - mapped <= max_staleness

    return trainable


@dataclass
class StalenessSplit(Generic[SampleT]):
    """Samples within the staleness bound, and those outside it."""

    kept: list[SampleT] = field(default_factory=list)
    dropped: list[SampleT] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    """Staleness of every input sample (kept and dropped), in input order."""

    @property
    def num_dropped(self) -> int:
        return len(self.dropped)


def split_by_staleness(
    samples: Sequence[SampleT],
    trainer_version: int,
    max_staleness: int,
    equivalent: Callable[[int], int] | None = None,
) -> StalenessSplit[SampleT]:
    """Samples with 0 <= staleness <= `max_staleness` kept, the rest dropped, order kept.

    A negative staleness (a version newer than the trainer's, e.g. rollouts of weights
    published before a crash and lost by the resume) is dropped too: no trainer version
    matches the policy that generated it.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    split: StalenessSplit[SampleT] = StalenessSplit()
    for sample in samples:
        staleness = sample_staleness(sample, trainer_version, equivalent)
        split.staleness.append(staleness)
        bucket = split.kept if 0 <= staleness <= max_staleness else split.dropped
        bucket.append(sample)
    return split


def staleness_histogram(staleness: Iterable[int]) -> dict[int, int]:
    """Count of samples per staleness value, keys ascending: [0, 2, 0, 1] -> {0: 2, 1: 1, 2: 1}."""
    return dict(sorted(Counter(staleness).items()))
