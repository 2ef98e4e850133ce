"""The same-host handoff on the bus: the trainer's notices and the workers' side of them.

    sharer = SameHostSharer(bus, SameHostShareConfig(signing_key=...))   # in the trainer
    await sharer.share(state, version, step)                   # after the slot is written
    taker = SameHostTaker(bus, SameHostTakeConfig(), verifier)  # in a rollout-worker
    await taker.start()
    notice = await taker.next_notice(after=held_version)       # the newest version shared
    reader = await taker.reader_for(notice)                    # None: cannot map its shelf

The shelf (libs/weights/same_host.py) is described in the state bucket, and every version
written into it is announced on core NATS (proto/same_host.py) and kept as the newest notice
in the bucket, so a worker that starts late, or missed a notice, still finds the newest
version within a poll. Sharing never stops training: a trainer that cannot make or fill its
shelf logs why and goes on with the delta chain alone.

Every notice is signed by the trainer (`signing_key`, the key the weight-broadcaster signs the
chain with; libs/weights/signing.py) and verified by the worker before it is considered: a
notice anyone else published on the subject or wrote to the bucket is refused, logged and
counted (rlpipe_weights_signature_refused_total{path="same_host"}), never copied. The notice
signs the slot's checksum, which the worker checks on its copy (`verify`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import structlog
import torch
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from prometheus_client import Counter, Histogram

from libs.bus import wire
from libs.bus.connection import Bus
from libs.weights.same_host import (
    SameHostShareConfig,
    SameHostTakeConfig,
    SameHostUnavailable,
    ShelfReader,
    ShelfWriter,
    resolve_host_id,
)
from libs.weights.signing import VersionRefused, VersionSigner, VersionVerifier
from proto import streams
from proto.same_host import (
    SameHostShelf,
    SameHostVersion,
    same_host_shelf_key,
    same_host_subject,
    same_host_version_key,
)

log = structlog.get_logger(__name__)

SHARE_SECONDS = Histogram(
    "rlpipe_weights_same_host_share_seconds",
    "Time the trainer took to write a version into its shelf and announce it",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
SHARE_FAILURES = Counter(
    "rlpipe_weights_same_host_share_failures_total", "Versions the trainer could not share"
)
# How often a worker polls the bucket for the newest notice when none arrived.
POLL_S = 1.0


class SameHostSharer:
    """The trainer's side: writes each published version into its shelf and announces it."""

    def __init__(self, bus: Bus, config: SameHostShareConfig) -> None:
        self._bus = bus
        self._config = config
        self.host_id = resolve_host_id(config.host_id)
        self._writer: ShelfWriter | None = None
        self._failed = False
        key = config.signing_key
        self._signer = VersionSigner.load(key) if key is not None else None
        if self._signer is None:
            log.warning("same-host versions are shared unsigned (no same_host.signing_key): "
                        "workers take them only with weights.allow_unsigned")  # fmt: skip
        self.policy_digest = ""  # the trainer's policy, signed into every notice

    @property
    def shelf(self) -> SameHostShelf | None:
        """The shelf shared now, if any."""
        return None if self._writer is None else self._writer.description

    async def share(
        self,
        state: Mapping[str, torch.Tensor],
        version: int,
        step: int | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> SameHostVersion | None:
        """Write `state` as `version` into the next slot and announce it; None when sharing
        failed (logged; the delta chain still carries every version). `ready`: ShelfWriter.write."""
        if self._failed:
            return None
        started = time.perf_counter()
        try:
            writer = await self._writer_for(state)
            notice = await asyncio.to_thread(writer.write, state, version, step, ready)
        except (RuntimeError, ValueError, OSError) as exc:
            # Out of card memory or shared memory: the chain goes on, this path stops.
            self._failed = True
            SHARE_FAILURES.inc()
            log.error("cannot share weights with this host's workers", error=repr(exc))
            return None
        if self._signer is not None:
            notice = self._signer.sign_same_host(notice, self.policy_digest)
        data, headers = wire.encode(notice), {wire.SCHEMA_HEADER: notice.schema_id()}
        await self._bus.nc.publish(same_host_subject(self.host_id), data, headers=headers)
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        await kv.put(same_host_version_key(self.host_id), data)
        SHARE_SECONDS.observe(time.perf_counter() - started)
        return notice

    async def _writer_for(self, state: Mapping[str, torch.Tensor]) -> ShelfWriter:
        """The shelf, made (and described in the bucket) on the first version, and made anew
        when the weights' layout changed."""
        if self._writer is not None and self._writer.fits(state):
            return self._writer
        if self._writer is not None:
            self._writer.close()
        slots = self._config.slots
        self._writer = await asyncio.to_thread(ShelfWriter.create, state, self.host_id, slots)
        shelf = self._writer.description
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        await kv.put(same_host_shelf_key(self.host_id), wire.encode(shelf))
        size_mb = sum(slot.size_bytes for slot in shelf.slots) / 2**20
        log.info("sharing weights with this host's workers", host_id=self.host_id,
                 kind=shelf.kind, slots=len(shelf.slots), size_mb=round(size_mb, 1))  # fmt: skip
        return self._writer

    async def close(self) -> None:
        """Release the shelf (workers that mapped it keep what they copied)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class SameHostTaker:
    """A worker's side: the newest version its host's trainer shared, and the shelf's map."""

    def __init__(self, bus: Bus, config: SameHostTakeConfig, verifier: VersionVerifier) -> None:
        self._bus = bus
        self.config = config
        self._verifier = verifier  # the delta chain's: the same keys sign both
        self.host_id = resolve_host_id(config.host_id)
        self._newest: SameHostVersion | None = None
        self._arrived = asyncio.Event()
        self._subscription: Subscription | None = None
        self._reader: ShelfReader | None = None
        self._unavailable: set[str] = set()  # shelves this process cannot map
        self.last_applied_s: float | None = None  # monotonic time of the last version taken
        self.num_applied = 0

    async def start(self) -> None:
        """Listen for notices, and read the newest one kept."""
        self._subscription = await self._bus.nc.subscribe(
            same_host_subject(self.host_id), cb=self._on_notice
        )
        await self._poll()
        newest = None if self._newest is None else self._newest.version
        log.info("taking weights from this host's trainer when it shares it",
                 host_id=self.host_id, newest=newest)  # fmt: skip

    async def _on_notice(self, msg: Msg) -> None:
        try:
            notice = wire.decode(SameHostVersion, msg.data, msg.headers)
        except wire.InvalidMessage as exc:
            log.warning("unreadable same-host notice ignored", error=str(exc))
            return
        self._offer(notice)

    def _offer(self, notice: SameHostVersion) -> None:
        if self._newest is not None and notice.version <= self._newest.version:
            return
        try:
            self._verifier.check_same_host(notice)
        except VersionRefused as exc:
            log.error("same-host notice refused", reason=exc.reason, error=str(exc),
                      version=notice.version)  # fmt: skip
            return
        if self._newest is None or notice.version > self._newest.version:
            self._newest = notice
            self._arrived.set()

    async def _poll(self) -> None:
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        try:
            entry = await kv.get(same_host_version_key(self.host_id))
        except (KeyNotFoundError, KeyDeletedError):
            return
        if entry.value:
            try:
                self._offer(wire.decode(SameHostVersion, entry.value, None))
            except wire.InvalidMessage as exc:
                log.warning("unreadable same-host notice in the bucket", error=str(exc))

    async def next_notice(self, after: int | None) -> SameHostVersion:
        """The newest notice of a version above `after` (any, for None) on a shelf this
        process can map; waits for one."""
        while True:
            notice = self._newest
            if (
                notice is not None
                and (after is None or notice.version > after)
                and notice.shelf_id not in self._unavailable
            ):
                return notice
            self._arrived.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when a
            # cancel comes as the wait ends (a notice arriving), and this loop then never ends.
            try:
                async with asyncio.timeout(POLL_S):
                    await self._arrived.wait()
            except TimeoutError:
                await self._poll()

    async def reader_for(self, notice: SameHostVersion) -> ShelfReader | None:
        """The map of the notice's shelf (read from the bucket and opened the first time);
        None when this process cannot map it (logged once per shelf)."""
        if self._reader is not None and self._reader.description.shelf_id == notice.shelf_id:
            return self._reader
        shelf = await self._read_shelf()
        if shelf is None or shelf.shelf_id != notice.shelf_id:
            return None  # the trainer made a new shelf since: its notice follows
        try:
            reader = await asyncio.to_thread(ShelfReader.open, shelf)
        except SameHostUnavailable as exc:
            self._unavailable.add(shelf.shelf_id)
            log.warning("cannot map the trainer's shelf: following the delta chain",
                        error=str(exc))  # fmt: skip
            return None
        if self._reader is not None:
            self._reader.close()
        self._reader = reader
        log.info("mapped the trainer's shelf", shelf_id=shelf.shelf_id, kind=shelf.kind)
        return reader

    async def _read_shelf(self) -> SameHostShelf | None:
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        try:
            entry = await kv.get(same_host_shelf_key(self.host_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return wire.decode(SameHostShelf, entry.value or b"", None)

    def applied(self) -> None:
        """Note that a version was taken this way (the delta chain waits meanwhile)."""
        self.last_applied_s = time.monotonic()
        self.num_applied += 1

    def quiet_for(self, now_s: float) -> float | None:
        """Seconds since the last version taken this way; None when none was."""
        return None if self.last_applied_s is None else now_s - self.last_applied_s

    async def close(self) -> None:
        """Stop listening and drop the map."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
