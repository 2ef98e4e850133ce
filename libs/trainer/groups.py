"""Scored rollouts gathered into GRPO groups (all samples of one task).

A group is complete when it holds `task.group_size` distinct samples. A group that stays
incomplete past a deadline (a worker lost some samples for good) is released as it is,
so its samples are not held forever; the trainer counts those.

A sample the trainer refused (dead-lettered: invalid for its policy) still counts toward its
group's size, so the rest of the group trains without waiting for the timeout. A sample of a
group already taken (a copy stored twice) is reported by `add` as a duplicate; the buffer
remembers the last `remember_groups` group ids taken for that.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from proto.messages import ScoredRollout


@dataclass
class Group:
    """The samples of one task seen so far, with their stream sequences."""

    group_id: str
    size: int
    first_seen_s: float
    samples: dict[int, tuple[int, ScoredRollout]] = field(default_factory=dict)
    # Sample indexes refused by the trainer (already dead-lettered and consumed).
    refused: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.samples) + len(self.refused) >= self.size

    @property
    def sequences(self) -> list[int]:
        return [seq for seq, _ in self.samples.values()]

    @property
    def rollouts(self) -> list[ScoredRollout]:
        return [sample for _, sample in sorted(self.samples.values(), key=lambda s: s[0])]


class GroupBuffer:
    """Collects samples by group id; hands out complete (or expired) groups in arrival order."""

    def __init__(
        self,
        incomplete_timeout_s: float = 120.0,
        remember_groups: int = 4096,
        taken: Iterable[str] = (),
    ) -> None:
        self._open: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._ready_ids: set[str] = set()
        self._timeout_s = incomplete_timeout_s
        self._remember = remember_groups
        self._taken: OrderedDict[str, None] = OrderedDict.fromkeys(taken)
        self.num_expired = 0

    @property
    def recently_taken(self) -> list[str]:
        """Group ids taken lately, oldest first (saved with the checkpoint)."""
        return list(self._taken)

    def add(
        self, sequence: int, sample: ScoredRollout, now_s: float | None = None
    ) -> Literal["added", "duplicate"]:
        """Buffer `sample`; "duplicate" when its group was taken already or holds its index
        (a copy stored twice): the caller consumes it without training it."""
        rollout = sample.rollout
        group = self._group(sample, now_s)
        if group is None or rollout.sample_index in group.samples:
            return "duplicate"
        group.samples[rollout.sample_index] = (sequence, sample)
        self._release_if_complete(group)
        return "added"

    def refuse(self, sample: ScoredRollout, now_s: float | None = None) -> None:
        """Count a refused sample toward its group's size (it was consumed elsewhere)."""
        group = self._group(sample, now_s)
        if group is not None:
            group.refused.add(sample.rollout.sample_index)
            self._release_if_complete(group)

    def _group(self, sample: ScoredRollout, now_s: float | None) -> Group | None:
        """The open group of `sample` (opened now if new); None if it was taken already."""
        rollout = sample.rollout
        if rollout.group_id in self._taken or rollout.group_id in self._ready_ids:
            return None
        group = self._open.get(rollout.group_id)
        if group is None:
            size = rollout.task.group_size if rollout.task else 1
            group = Group(rollout.group_id, size, now_s if now_s is not None else time.monotonic())
            self._open[rollout.group_id] = group
        return group

    def _release_if_complete(self, group: Group) -> None:
        if group.complete:
            self._release(group.group_id)

    def _release(self, group_id: str) -> None:
        self._ready.append(self._open.pop(group_id))
        self._ready_ids.add(group_id)

    def expire(self, now_s: float | None = None) -> None:
        """Release groups that have waited longer than the timeout for missing samples."""
        now_s = now_s if now_s is not None else time.monotonic()
        for group_id, group in list(self._open.items()):
            if now_s - group.first_seen_s > self._timeout_s:
                self._release(group_id)
                self.num_expired += 1

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def put_back(self, groups: list[Group]) -> None:
        """Return groups taken for a step that did not happen (a stop mid-batch): ready
        again, first in line, and not remembered as taken."""
        for group in groups:
            self._taken.pop(group.group_id, None)
            self._ready_ids.add(group.group_id)
        self._ready = groups + self._ready

    def take(self, num_groups: int) -> list[Group]:
        taken, self._ready = self._ready[:num_groups], self._ready[num_groups:]
        for group in taken:
            self._ready_ids.discard(group.group_id)
            self._taken[group.group_id] = None
        while len(self._taken) > self._remember:
            self._taken.popitem(last=False)
        return taken
