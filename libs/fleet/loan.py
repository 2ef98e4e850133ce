"""One loan of a serve replica to RL: the trainer's versions in its engine, tasks pulled,
and the way back to the promoted version, bit-exactly.

    loan = Loan(parts, held, shadow)            # held: the promoted VersionInfo the engine holds
    await loan.take_weights(state_js)           # the trainer's newest version, written in place
    loan.pull_tasks()                           # tasks rolled out until finish_tasks
    await loan.finish_tasks(recall_grace_s)     # finished within the grace, else requeued
    record = await loan.restore()               # proto.fleet.RecallRecord

Weights: a second weights follower (`LentFollower`, libs/rollout/weights_follower.py), not
promoted-only, writes the trainer's chain into the engine's live tensors, starting from the
promoted version they hold (the next delta on it, or a newer snapshot), each version
verified as always. The replica's own follower keeps the promoted version's host copy (its
shadow) untouched while the loan lasts (the caller holds its `promotions` lock).

Episodes: the rollout-worker's own task handler runs each task; `finish_tasks` stops
pulling, lets the tasks in flight finish for `grace_s` (their rollouts are published and the
tasks acked), and hands the rest back to the queue (nak: redelivered at once, to any worker,
under the same rollout ids, so the stream's dedup keeps one copy of each rollout). Then
`restore` copies the shadow back into the engine and hashes the live weights against the
promoted version's signed hash; a mismatch raises RestoreError (the replica cannot serve
what it was promoted to serve, and stops loudly).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from libs.bus.connection import Bus
from libs.bus.consumer import Handler, PullConsumer
from libs.bus.dead_letter import Delivery
from libs.engine.base import InferenceEngine
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.weights_follower import POLICY_VERSION, WeightsFollower
from libs.weights.format import VersionInfo
from libs.weights.gpu import device_state_hash
from libs.weights.receiver import ReceiverConfig, WeightReceiver
from proto.fleet import RecallRecord
from proto.messages import Task

log = structlog.get_logger(__name__)


class RestoreError(RuntimeError):
    """The restored weights do not hash to the promoted version's hash."""


class LentFollower(WeightsFollower):
    """A weights follower that starts from the version the engine's live tensors hold, and
    can be stopped between two writes."""

    def assume_held(self, held: VersionInfo, names: list[str]) -> None:
        """Follow on from `held`, which the live tensors `names` hold (the next delta on it
        is written there in place)."""
        assert self._host is not None, "a lent engine exposes its live tensors"
        self.receiver.reset(held)
        self._state = {name: self._host[name] for name in names}
        self.usable = True

    @contextlib.asynccontextmanager
    async def writes_held(self) -> AsyncIterator[None]:
        """Inside, no version is being written (`run` may be cancelled safely)."""
        async with self._write_lock:
            yield


@dataclass
class ReplicaParts:
    """What a loan moves around: the serve replica's engine, batcher and promoted follower,
    where versions come from, and how its tasks are pulled and handled."""

    engine: InferenceEngine
    batcher: GenerationBatcher
    follower: WeightsFollower
    weights_bus: Bus
    receiver_config: ReceiverConfig
    new_consumer: Callable[[Handler[Task]], PullConsumer[Task]]
    on_task: Handler[Task]


class Loan:
    """The trainer's versions and tasks on a serve replica, until `end`."""

    def __init__(self, parts: ReplicaParts, held: VersionInfo, shadow: dict[str, Any]) -> None:
        self.parts = parts
        self.held = held
        self.shadow = shadow
        config = parts.receiver_config.model_copy(update={"promoted_only": False})
        # The replica's kind of receiver (a region's waits for its mirror's chunks).
        self.receiver: WeightReceiver = type(parts.follower.receiver)(parts.weights_bus, config)
        self.receiver.verifier.expected_policy = parts.follower.receiver.verifier.expected_policy
        self.follower = LentFollower(parts.engine, self.receiver, parts.batcher)
        # The replica's book: its rollouts' turns name the lent versions by hash too.
        self.follower.versions = parts.follower.versions
        self._following: asyncio.Task[None] | None = None
        self._consumer: PullConsumer[Task] | None = None
        self._pulling: asyncio.Task[None] | None = None
        self.in_flight: dict[str, int] = {}  # task id -> episodes
        self.num_tasks_done = 0
        self._ending = False
        self._record = RecallRecord()

    @property
    def episodes_in_flight(self) -> int:
        return sum(self.in_flight.values())

    async def take_weights(self, state_js: Any) -> None:
        """Follow the trainer's chain from the promoted version into the engine, until it
        holds the version newest now (the caller bounds the wait)."""
        self.follower.assume_held(self.held, list(self.shadow))
        await self.follower.start(self.parts.weights_bus.js, state_js=state_js)
        self._following = asyncio.create_task(self.follower.run(), name="loan-weights")
        caught_up = asyncio.ensure_future(self.follower.wait_caught_up())
        try:
            done, _ = await asyncio.wait(
                {caught_up, self._following}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            caught_up.cancel()  # done, or given up (a recall): nobody waits on it
        if caught_up not in done:
            self._following.result()  # re-raise what ended the follower
        log.info("lent replica holds the trainer's version", version=self.version)

    @property
    def version(self) -> int | None:
        return self.follower.policy_version

    def pull_tasks(self) -> None:
        self._consumer = self.parts.new_consumer(self._handle)
        self._pulling = asyncio.create_task(self._consumer.run(), name="loan-tasks")

    async def ended_badly(self) -> None:
        """Returns only if the loan's weights or task loop ends on its own (it raises)."""
        running = [t for t in (self._following, self._pulling) if t is not None]
        if not running:
            await asyncio.Event().wait()
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
        raise RuntimeError("a loan's loop ended on its own")

    async def _handle(self, task: Task, delivery: Delivery) -> None:
        self.in_flight[task.task_id] = task.group_size
        try:
            await self.parts.on_task(task, delivery)
        except asyncio.CancelledError:
            if self._ending:  # the consumer hands it back (nak)
                self._record.tasks_requeued += 1
                self._record.episodes_requeued += task.group_size
                self._record.requeued_task_ids.append(task.task_id)
            raise
        else:
            self.num_tasks_done += 1
            if self._ending:
                self._record.tasks_finished += 1
                self._record.episodes_finished += task.group_size
        finally:
            del self.in_flight[task.task_id]

    async def finish_tasks(self, grace_s: float) -> None:
        """Stop pulling; tasks in flight finish within `grace_s`, the rest are requeued."""
        self._ending = True
        self._record.tasks_in_flight = len(self.in_flight)
        if self._consumer is not None and self._pulling is not None:
            await self._consumer.stop(grace_s=grace_s)
            while self.in_flight:  # cancelled handlers close their episodes first
                await asyncio.sleep(0.01)
            await _finished(self._pulling)

    async def restore(self) -> RecallRecord:
        """Stop following the trainer, restore the promoted version and check its hash."""
        await self._stop_following()
        await self._restore()
        return self._record

    async def _stop_following(self) -> None:
        if self._following is not None:
            async with self.follower.writes_held():  # never cancelled inside a write
                self._following.cancel()
                await _finished(self._following)
        await self.receiver.close()

    async def _restore(self) -> None:
        """Copy the shadow back into the engine as the promoted version, then hash it."""
        engine, held = self.parts.engine, self.held
        assert held.version is not None, "a promoted version has a number"
        async with self.parts.batcher.gate:  # nothing generates until it is checked
            started = time.monotonic()
            await asyncio.to_thread(engine.restore_weights, self.shadow, held.version)
            live = engine.live_tensors()
            assert live is not None, "a lent engine exposes its live tensors"
            state = {name: live[name] for name in self.shadow}
            threads = self.receiver.config.decode_threads
            digest = await asyncio.to_thread(device_state_hash, state, threads)
        self._record.restored_version = held.version
        self._record.restored_hash = digest
        self._record.hash_matches = digest == held.hash
        if not self._record.hash_matches:
            raise RestoreError(
                f"restored weights hash to {digest[:16]}, promoted version {held.version} "
                f"is {held.hash[:16]}: this replica cannot serve its promoted version"
            )
        # Generation opens again (a failed loan version may have closed it) with `held`.
        self.parts.follower.versions.record(held.version, held.hash)
        self.parts.batcher.open.set()
        POLICY_VERSION.set(held.version)
        log.info("promoted version restored", version=held.version, hash=digest[:16],
                 seconds=round(time.monotonic() - started, 3))  # fmt: skip


async def _finished(task: asyncio.Task[None]) -> None:
    """Wait for `task` to end; a cancellation or the error it ended with is not ours."""
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
