"""Which policy version sampled which token of a completion or turn that spans weight swaps.

The `paged` engine swaps weights between decode steps under running calls, so one
completion's tokens can come from several versions. `version_switches` (on
`libs.engine.base.Completion` and `proto.messages.Turn`) records them compactly: (index of
the first token sampled with a version, that version) for every change from the turn's
`policy_version`, in token order; the last one's version is `policy_version_end`. Empty when
one version sampled every token (or, with `policy_version_end` set, when the producer did
not record where the versions changed: an older worker).

    token_versions(0, ((3, 1), (7, 2)), 9)   # [0, 0, 0, 1, 1, 1, 1, 2, 2]
    cut_switches(((3, 1), (7, 2)), 5)        # ((3, 1),): the switches of the first 5 tokens
    end_version(((3, 1),))                   # 1 (None without switches)
    switches_problem(0, 1, ((3, 1),), 9)     # None; else what is wrong, in words

Plain Python: any process that speaks the contract can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

VersionSwitches = tuple[tuple[int, int], ...]
"""(index of the first token sampled with a version, that version), in token order."""


def token_versions(first: int, switches: Sequence[tuple[int, int]], num_tokens: int) -> list[int]:
    """The version that sampled each of `num_tokens` tokens: `first` up to the first switch,
    then each switch's version from its index on."""
    versions: list[int] = []
    version = first
    for index, switched_to in switches:
        versions.extend([version] * (min(index, num_tokens) - len(versions)))
        version = switched_to
    versions.extend([version] * (num_tokens - len(versions)))
    return versions


def cut_switches(switches: Sequence[tuple[int, int]], num_tokens: int) -> VersionSwitches:
    """The switches of the first `num_tokens` tokens (a completion or turn cut there)."""
    return tuple((index, version) for index, version in switches if index < num_tokens)


def end_version(switches: Sequence[tuple[int, int]]) -> int | None:
    """The version of the last token, when switches say it changed; None without any."""
    return switches[-1][1] if switches else None


def switches_problem(
    first: int | None, end: int | None, switches: Sequence[tuple[int, int]], num_tokens: int
) -> str | None:
    """What makes `switches` inconsistent with a turn of `num_tokens` tokens whose first
    version is `first` and last `end` (policy_version, policy_version_end); None if nothing."""
    if not switches:
        return None
    if first is None:
        return "version switches on a turn without policy_version"
    indices = [index for index, _ in switches]
    versions = [first, *(version for _, version in switches)]
    if any(b <= a for a, b in pairwise(indices)):
        return f"switch indices {indices} are not increasing"
    if indices[0] < 0 or indices[-1] >= num_tokens:
        return f"switch indices {indices} not all in 0..{num_tokens - 1} (the turn's tokens)"
    if any(b <= a for a, b in pairwise(versions)):
        return f"versions {versions} (policy_version, then each switch's) are not increasing"
    if end != versions[-1]:
        return f"the last switch's version {versions[-1]} is not policy_version_end {end}"
    return None
