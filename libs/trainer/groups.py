"""Scored rollouts gathered into GRPO groups (all samples of one task).

A group is complete when it holds `task.group_size` distinct samples. A group that stays
incomplete past a deadline (a worker lost some samples for good) is released as it is,
so its samples are not held forever; the trainer counts those.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from proto.messages import ScoredRollout


@dataclass
class Group:
    """The samples of one task seen so far, with their stream sequences."""

    group_id: str
    size: int
    first_seen_s: float
    samples: dict[int, tuple[int, ScoredRollout]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.size

    @property
    def sequences(self) -> list[int]:
        return [seq for seq, _ in self.samples.values()]

    @property
    def rollouts(self) -> list[ScoredRollout]:
        return [sample for _, sample in sorted(self.samples.values(), key=lambda s: s[0])]


class GroupBuffer:
    """Collects samples by group id; hands out complete (or expired) groups in arrival order."""

    def __init__(self, incomplete_timeout_s: float = 120.0) -> None:
        self._open: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._timeout_s = incomplete_timeout_s
        self.num_expired = 0

    def add(self, sequence: int, sample: ScoredRollout, now_s: float | None = None) -> None:
        rollout = sample.rollout
        group = self._open.get(rollout.group_id)
        if group is None:
            size = rollout.task.group_size if rollout.task else 1
            group = Group(rollout.group_id, size, now_s if now_s is not None else time.monotonic())
            self._open[rollout.group_id] = group
        # A sample index seen twice (a redelivered duplicate) keeps its first copy.
        group.samples.setdefault(rollout.sample_index, (sequence, sample))
        if group.complete:
            self._ready.append(self._open.pop(rollout.group_id))

    def expire(self, now_s: float | None = None) -> None:
        """Release groups that have waited longer than the timeout for missing samples."""
        now_s = now_s if now_s is not None else time.monotonic()
        for group_id, group in list(self._open.items()):
            if now_s - group.first_seen_s > self._timeout_s:
                self._ready.append(self._open.pop(group_id))
                self.num_expired += 1

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def take(self, num_groups: int) -> list[Group]:
        taken, self._ready = self._ready[:num_groups], self._ready[num_groups:]
        return taken
