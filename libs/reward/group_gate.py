"""Holding the rollouts of a GRPO group until all of it arrived, then scoring it once.

    gate = GroupGate(on_group, timeout_s=60)
    await gate.add(rollout)     # returns once the rollout's whole group was handled

`add` waits until the group holds `task.group_size` distinct rollouts (or `timeout_s` after
its first one arrived: then the partial group is handled with a note saying so), runs
`on_group(rollouts, note)` once for the group, and returns in every caller when it is done,
or raises its error in every caller. A message handler that calls `add` therefore returns
(and its message is acked) only after the whole group's effect is durable; if the process
dies first, nothing was acked and the whole group is redelivered.

A rollout id seen again while its group is open (a redelivery) joins the same wait. One that
arrives after its group was handled opens a new group, which times out as partial: a scorer
with group criteria must see whole groups, so run one reward replica per set of groups.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from proto.messages import Rollout

log = structlog.get_logger(__name__)

OnGroup = Callable[[list[Rollout], str], Awaitable[None]]


@dataclass
class _OpenGroup:
    size: int
    done: asyncio.Future[None]
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    timer: asyncio.Task[None] | None = None


class GroupGate:
    """Buffers rollouts by group id; hands each group to `on_group` once, complete or late."""

    def __init__(self, on_group: OnGroup, timeout_s: float) -> None:
        self._on_group = on_group
        self._timeout_s = timeout_s
        self._open: dict[str, _OpenGroup] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.num_partial = 0

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def add(self, rollout: Rollout) -> None:
        """Wait until the group of `rollout` was handled; raise what handling it raised."""
        group = self._open.get(rollout.group_id)
        if group is None:
            size = rollout.task.group_size if rollout.task else 1
            group = _OpenGroup(size, asyncio.get_running_loop().create_future())
            self._open[rollout.group_id] = group
            group.timer = asyncio.create_task(self._expire(rollout.group_id, group))
        group.rollouts.setdefault(rollout.rollout_id, rollout)
        if len(group.rollouts) >= group.size:
            self._close(rollout.group_id, group, note="")
        await asyncio.shield(group.done)

    async def _expire(self, group_id: str, group: _OpenGroup) -> None:
        await asyncio.sleep(self._timeout_s)
        note = (
            f"partial group: {len(group.rollouts)} of {group.size} samples arrived within "
            f"{self._timeout_s:g} s"
        )
        self.num_partial += 1
        log.warning("scoring a partial group", group_id=group_id, note=note)
        self._close(group_id, group, note)

    def _close(self, group_id: str, group: _OpenGroup, note: str) -> None:
        if self._open.get(group_id) is not group:
            return  # already closed
        del self._open[group_id]
        if group.timer is not None and note == "":
            group.timer.cancel()
        task = asyncio.create_task(self._handle(group, note))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _handle(self, group: _OpenGroup, note: str) -> None:
        ordered = sorted(group.rollouts.values(), key=lambda r: (r.sample_index, r.rollout_id))
        try:
            await self._on_group(ordered, note)
        except Exception as exc:
            group.done.set_exception(exc)
            return
        group.done.set_result(None)

    async def stop(self) -> None:
        """Forget open groups (their callers were cancelled: their messages are nak'd and
        redelivered) and let groups being handled finish."""
        for group in self._open.values():
            if group.timer is not None:
                group.timer.cancel()
            if not group.done.done():
                group.done.cancel()
        self._open.clear()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._closing, return_exceptions=True)
