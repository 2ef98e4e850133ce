"""The trainer's version publisher: numbers its versions, hands their weights to the
weight-broadcaster, and tells the feeder how far the trainer is.

    versions = VersionPublisher(bus, publisher, learner, state, staging_dir)
    await versions.start(identity, resumed=True)   # a number above any announced, staged
    ...one optimizer step: state.version += 1...
    await versions.publish()          # progress to the KV bucket, then the weights staged
    await versions.record_progress()  # progress only (a step not published)
    await versions.close()            # the newest version offered is staged

Versions never repeat: a starting trainer publishes its weights as a version above every
version announced before (read from the KV bucket), so after a crash workers roll back to
the checkpoint's weights under a new number (libs.trainer.lineage keeps staleness counting
updates, not numbers). The KV write of a version comes before its weights are offered, so a
crash in between can only skip a number, never reuse it. Staging runs in the background
(libs.trainer.staging); a handover that failed raises from `raise_if_failed`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog
import torch
from nats.js.errors import KeyNotFoundError

from libs.bus.connection import Bus, ride_through
from libs.bus.publisher import Publisher
from libs.cuda_device import cuda_device_of, recorded_event
from libs.policy_identity import store_identity
from libs.trainer.checkpoint import TrainerState
from libs.trainer.learner import Learner
from libs.trainer.staging import WeightStager
from libs.weights.encoder import EncodeOptions, chunk_bytes_for
from libs.weights.same_host_link import SameHostSharer
from libs.weights.signing import policy_digest
from proto import streams
from proto.messages import PolicyIdentity

log = structlog.get_logger(__name__)


class VersionPublisher:
    """Publishes the versions of one trainer: their numbers, progress and weights."""

    def __init__(
        self,
        bus: Bus,
        publisher: Publisher,
        learner: Learner,
        state: TrainerState,
        staging_dir: Path,
    ) -> None:
        self._bus = bus
        self._learner = learner
        self._state = state
        config = learner.config
        assert config.max_staleness is not None, "the learner sizes the config"
        # The bound the feeder reads; the trainer's pacer moves it (libs.trainer.pacing).
        self.max_staleness = config.max_staleness
        self._stager = WeightStager(
            publisher, staging_dir, deltas=self._hands_over_deltas(),
            options=EncodeOptions(
                max_chunk_bytes=chunk_bytes_for(bus.nc.max_payload),
                threads=config.handover_threads,
            ),
        )  # fmt: skip
        self._sharer = SameHostSharer(bus, config.same_host) if config.same_host.enabled else None
        self._sharing: asyncio.Task[None] | None = None
        # The newest version this host's workers can take from the trainer's memory.
        self.shared_version: int | None = None

    def _hands_over_deltas(self) -> bool:
        """Whether the stager encodes deltas itself (config.weight_handover)."""
        handover = self._learner.config.weight_handover
        if handover == "auto":
            return any(p.is_cuda for p in self._learner.model.parameters())
        return handover == "delta"

    async def start(self, identity: PolicyIdentity, resumed: bool) -> None:
        """Store the policy's identity, take a version number above any announced (the
        lineage notes it when `resumed` from a checkpoint), publish the weights held and
        wait until they are staged: workers start from them, before any step."""
        await store_identity(self._bus.js, identity)
        if self._sharer is not None:
            self._sharer.policy_digest = policy_digest(identity)
        announced = await self._announced_version()
        if announced is not None:
            state = self._state
            resumed_from = state.version
            state.version = max(state.version, announced) + 1
            if resumed:
                state.lineage = state.lineage.resumed(resumed_from, state.version)
        await self.publish()
        await self._stager.flush()

    async def publish(self) -> None:
        """Record the version as taken (KV), share a copy of the weights with this host's
        workers, then hand it to the stager, which stages it in the background (a version
        still waiting is replaced: the newest ships first, libs/trainer/staging.py).

        Only the copy is made in line (the next step changes the weights); sharing it runs
        beside the next step (on its own stream on a card), one version at a time, so the
        trainer does not wait for the slot's copy, checksum and announcement."""
        await self.record_progress()
        state = self._state
        weights = await asyncio.to_thread(self._learner.published_state)
        if self._sharer is not None:
            ready = _made_event(weights)
            await self._shared()  # the version before: slots are written in turn
            share = self._share(weights, state.version, state.step, ready)
            self._sharing = asyncio.create_task(share, name="same-host-share")
        await self._stager.offer(weights, state.version, step=state.step)

    async def _share(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        step: int,
        ready: torch.cuda.Event | None,
    ) -> None:
        assert self._sharer is not None
        if await self._sharer.share(weights, version, step=step, ready=ready) is not None:
            self.shared_version = version

    async def _shared(self) -> None:
        """Wait for the version being shared, if any (its failure is logged by the sharer;
        anything else it raised is raised here)."""
        sharing, self._sharing = self._sharing, None
        if sharing is not None:
            await sharing

    async def record_progress(self) -> None:
        """Publish the version, the groups taken, the staleness bound and the batch size to the
        KV bucket (the feeder reads them); rides through a NATS restart."""
        state = self._state

        async def write() -> None:
            kv = await self._bus.js.key_value(streams.STATE.bucket)
            await kv.put(streams.POLICY_VERSION_KEY, str(state.version).encode())
            await kv.put(streams.GROUPS_TAKEN_KEY, str(state.groups_taken).encode())
            await kv.put(streams.MAX_STALENESS_KEY, str(self.max_staleness).encode())
            await kv.put(streams.BATCH_GROUPS_KEY, str(self._learner.config.batch_groups).encode())

        await ride_through(write, "trainer progress")

    async def _announced_version(self) -> int | None:
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        try:
            entry = await kv.get(streams.POLICY_VERSION_KEY)
        except KeyNotFoundError:
            return None
        return int((entry.value or b"0").decode())

    def raise_if_failed(self) -> None:
        """Raise the error of a handover that failed: its version never reaches the workers."""
        self._stager.raise_if_failed()

    async def close(self) -> None:
        """Stage the newest version offered, then stop staging and sharing."""
        try:
            await self._stager.close()
        finally:
            if self._sharer is not None:
                try:
                    await self._shared()
                finally:
                    await self._sharer.close()


def _made_event(weights: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
    """An event recorded after the copy `weights` was queued on this thread's stream (on a
    card; None on a CPU): what the share's own stream waits for, and nothing later."""
    device = cuda_device_of(weights.values())
    return None if device is None else recorded_event(device)
