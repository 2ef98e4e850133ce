"""The weight-broadcaster service: a durable consumer of staged versions around the
library's WeightBroadcaster (libs/weights/broadcaster.py), which does the work.

/healthz answers 503 ("failing", with the reason) from the first staged version that could
not be broadcast until one is: e.g. a staging folder the trainer does not share."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from libs.background_tasks import BackgroundTasks
from libs.bus.connection import Bus
from libs.bus.consumer import PullConsumer
from libs.bus.publisher import Publisher
from libs.service import Service
from libs.weights.broadcaster import WeightBroadcaster
from libs.weights.encoder import chunk_bytes_for
from libs.weights.handoff import release_shm
from libs.weights.signing import VersionSigner
from proto.messages import WeightsStaged
from proto.streams import WEIGHT_BROADCASTER_STAGED
from services.weight_broadcaster.settings import WeightBroadcasterSettings

log = structlog.get_logger(__name__)


class WeightBroadcasterService(Service):
    """Takes staged versions one at a time, in order; health reports the chain."""

    name = "weight-broadcaster"

    def __init__(self, settings: WeightBroadcasterSettings) -> None:
        super().__init__()
        self.settings = settings
        self.broadcaster: WeightBroadcaster | None = None
        self._consumer: PullConsumer[WeightsStaged] | None = None

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        settings = self.settings
        publisher = Publisher(bus.js, max_in_flight=settings.publish_in_flight)
        chunk_bytes = chunk_bytes_for(bus.nc.max_payload, settings.encode.max_chunk_bytes)
        options = settings.encode.model_copy(update={"max_chunk_bytes": chunk_bytes})
        staging_dir = settings.resolved_staging_dir()
        staging_dir.mkdir(parents=True, exist_ok=True)
        key = settings.signing_key
        signer = VersionSigner.load(key) if key is not None else None
        if signer is None:
            log.warning("weight versions are announced unsigned (allow_unsigned)")
        else:
            log.info("signing weight versions", key_id=signer.key_id)
        self.broadcaster = WeightBroadcaster(
            bus,
            publisher,
            staging_dir,
            signer=signer,
            snapshot_every=settings.snapshot_every_versions,
            options=options,
            diff_device=settings.diff_device,
        )
        await self.broadcaster.recover()
        self._consumer = PullConsumer(
            bus.js,
            WEIGHT_BROADCASTER_STAGED,
            WeightsStaged,
            self.broadcaster.on_staged,
            publisher,
            batch_size=1,
            concurrency=1,  # versions are encoded in order, each against the previous one
            fetch_timeout_s=1.0,
        )
        self.status = "ok"
        self.detail = f"staging folder {staging_dir}"

    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        idle = self.settings.snapshot_when_idle_s
        async with BackgroundTasks() as tasks:
            if idle > 0:
                tasks.start("idle-snapshots", self._snapshot_when_idle(idle))
            await tasks.until(self._consumer.run())

    async def _snapshot_when_idle(self, idle_s: float) -> None:
        """Check every few seconds whether the head needs a snapshot for want of versions."""
        assert self.broadcaster is not None
        while True:
            await asyncio.sleep(min(5.0, idle_s / 4))
            try:
                await self.broadcaster.snapshot_when_idle(idle_s)
            except Exception as exc:  # the next check tries again; staged versions go on
                self.broadcaster.failures.failed(f"idle snapshot: {exc}")
                log.error("idle snapshot failed", error=repr(exc))

    async def stop(self) -> None:
        await super().stop()
        if self._consumer is not None:
            await self._consumer.stop(grace_s=self.settings.drain_timeout_s)
        await asyncio.to_thread(release_shm, self.settings.resolved_staging_dir())

    def health(self) -> dict[str, Any]:
        """The chain; unhealthy, with the reason, while staged versions fail to broadcast."""
        chain = self.broadcaster.health() if self.broadcaster else {}
        report = {**super().health(), **chain}
        problem = self.broadcaster.failures.problem() if self.broadcaster else None
        if problem is not None:
            report |= {"status": "failing", "detail": problem}
        return report
