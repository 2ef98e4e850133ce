"""The weight-broadcaster's logic: staged versions in, stored chunks and announcements out.

For each staged version (libs/weights/handoff.py), in order (a version with a newer one
already waiting behind it is skipped: the newer one is what workers need, and the delta is
encoded against the last announced version either way):

1. encode a delta against the previous version (the codec, bit-exact; the base is the
   previous staged file, memory-mapped), store its chunks (transport.py) and announce it on
   `rl.weights.announce.delta`;
2. every `snapshot_every` deltas, and for the first version, also encode the full version,
   store it and announce it on `rl.weights.announce.snapshot` (after the delta, so a worker
   one version behind takes the small delta and a late joiner the snapshot); also when the
   head is a delta and no version came for a while (`snapshot_when_idle`: a worker that lost
   a delta waits for a snapshot, and the trainer may be waiting for that worker);
3. after a snapshot at version v, purge everything before v from the chunk and announce
   streams (by sequence: versions are stored in order): no receiver needs it, since a late
   one catches up from snapshot v plus the deltas after it (receiver.py);
4. delete staged files older than v; the latest stays as the next delta's base.

With `diff_device` set (e.g. "cuda" where the broadcaster shares the trainer's GPU host),
the changed elements of tensors that are not dense are found on that device (DeviceBase:
the same chunks byte for byte); dense tensors are encoded on the host as before. On a GPU
host the host scan is most of a sparse delta's encode.

A staged delta (kind "delta": the trainer encoded it against the version it staged before,
libs/trainer/staging.py) is stored and announced as it is when its base is the chain's head,
and refused otherwise; it is never skipped (the trainer's next delta builds on it). The
broadcaster then applies it to its own host copy of the head, off the version's path, for
the snapshots and for a later whole version's delta.

Its state lives on the bus, not in memory: every announcement carries its chain position
(snapshot_version, chain_length), so a restarted broadcaster reads the last delta and the last
snapshot announcements (two direct gets), and takes the base of the next delta from the
staged file if it is still there and hashes right, else rebuilds it from the bus (snapshot
plus deltas, as a receiver). A staged version that is already announced (a redelivery after
a crash) is skipped, or finished if its snapshot was still due.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import structlog
from prometheus_client import Counter, Gauge, Histogram

from libs.bus.connection import Bus
from libs.bus.consumer import Delivery, PermanentError
from libs.bus.publisher import Publisher
from libs.weights.announcements import announced_head, read_policy_digest
from libs.weights.applier import DeltaApplier
from libs.weights.encoder import EncodeOptions, EncodeTimes, encode, encode_snapshot
from libs.weights.errors import WeightsError
from libs.weights.format import Chunk, Manifest, VersionInfo
from libs.weights.handoff import (
    load_staged,
    load_staged_delta,
    remove_staged_before,
    staged_file_name,
    staged_versions,
)
from libs.weights.hashing import state_hash
from libs.weights.receiver import ReceiverConfig, WeightReceiver
from libs.weights.retention import purge_before_latest_snapshot
from libs.weights.scan import Changes
from libs.weights.signing import VersionSigner, chain_verifier
from libs.weights.tensors import RawTensor, check_dtype, torch_dtype
from libs.weights.transport import StoredChunks, store_chunks
from libs.work_health import FailureWatch
from proto import streams
from proto.messages import WeightAnnouncement, WeightKind, WeightsStaged
from proto.subjects import weights_announce_subject

if TYPE_CHECKING:
    import torch
    from nats.js import JetStreamContext

log = structlog.get_logger(__name__)

ENCODE_SECONDS = Histogram(
    "rlpipe_weights_encode_seconds",
    "Time to encode a version",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
STORE_SECONDS = Histogram(
    "rlpipe_weights_store_seconds",
    "Time to store a version's chunks on the bus",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
STORED_BYTES = Counter(
    "rlpipe_weights_stored_bytes_total", "Bytes of weight chunks stored on the bus", ["kind"]
)
MODEL_BYTES = Counter(
    "rlpipe_weights_model_bytes_total", "Bytes of model versions encoded", ["kind"]
)
COMPRESSION_RATIO = Gauge(
    "rlpipe_weights_compression_ratio",
    "Model bytes over stored bytes of the latest version",
    ["kind"],
)
SUPERSEDED = Counter(
    "rlpipe_weights_superseded_total",
    "Staged versions skipped because a newer one was already waiting",
)
LATEST_VERSION = Gauge("rlpipe_weights_latest_version", "Latest announced policy version")
SNAPSHOT_VERSION = Gauge("rlpipe_weights_snapshot_version", "Version of the latest snapshot")
CHAIN_LENGTH = Gauge("rlpipe_weights_chain_length", "Deltas announced since the latest snapshot")


class DeviceBase:
    """Tensors of the chain head kept on a torch device, where `encode`'s scan of a tensor
    that is not dense runs (`device_changes`: only the changed elements come back). A tensor
    is copied up when it is scanned, so dense tensors (encoded on the host against the staged
    base) never cross; a cached tensor is used only while it holds the head's version."""

    def __init__(self, device: str) -> None:
        import torch  # only where deltas are found on a device

        self.device = torch.device(device)
        self._held: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (version, tensor)

    def encode(
        self,
        head: ChainHead,
        base: Mapping[str, RawTensor],
        new: Mapping[str, RawTensor],
        version: int,
        options: EncodeOptions,
        times: EncodeTimes | None = None,
    ) -> tuple[Manifest, list[Chunk]]:
        """The delta head -> `new`, the same chunks as `encode(base, new)` makes."""
        from libs.weights.gpu import device_changes

        def scan(name: str, old: RawTensor, target: RawTensor) -> Changes:
            held = self._held.get(name)
            before = held[1] if held is not None and held[0] == head.version else None
            after = self._upload(target)
            changes = device_changes(self._upload(old) if before is None else before, after)
            self._held[name] = (version, after)
            return changes

        return encode(
            base, new, base_version=head.version, version=version, options=options,
            base_hash=head.hash, scan=scan, times=times,
        )  # fmt: skip

    def _upload(self, raw: RawTensor) -> torch.Tensor:
        import torch

        with warnings.catch_warnings():  # read-only (memory-mapped) bytes, only read here
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(raw.data)
        return host.view(torch_dtype(raw.dtype)).reshape(raw.shape).to(self.device)


@dataclass(frozen=True)
class ChainHead:
    """The latest announced version and its place in the snapshot chain."""

    version: int
    hash: str
    snapshot_version: int
    chain_length: int  # deltas after the snapshot, up to and including `version`


class WeightBroadcaster:
    """Encodes, stores and announces staged versions; keeps the chain on the bus."""

    def __init__(
        self,
        bus: Bus,
        publisher: Publisher,
        staging_dir: str | Path,
        *,
        signer: VersionSigner | None,
        snapshot_every: int = 10,
        options: EncodeOptions | None = None,
        announce_stream: str = streams.WEIGHTS_ANNOUNCE.name,
        chunk_stream: str = streams.WEIGHT_CHUNKS.name,
        diff_device: str | None = None,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self._bus = bus
        self._publisher = publisher
        self.staging_dir = Path(staging_dir)
        self.snapshot_every = snapshot_every
        self.options = options or EncodeOptions()
        self._announce_stream = announce_stream
        self._chunk_stream = chunk_stream
        self.head: ChainHead | None = None
        self._base: Mapping[str, RawTensor] | None = None  # the state of head.version
        # The head's state being brought along by the staged deltas announced (applied in
        # order, beside the next versions; awaited where the state is needed).
        self._advancing: asyncio.Task[Mapping[str, RawTensor] | None] | None = None
        self._device_base = DeviceBase(diff_device) if diff_device is not None else None
        self._signer, self._verifier = signer, chain_verifier(signer)  # None: unsigned
        self.num_handled = 0
        # Staged versions and idle snapshots take turns on the chain.
        self._chain_lock = asyncio.Lock()
        self._last_activity_s = time.monotonic()
        # A version that could not be broadcast (e.g. its staged file is unreadable) makes
        # /healthz fail until one is, with the reason.
        self.failures = FailureWatch("broadcasting staged versions")

    # ---- recovery ----------------------------------------------------------------------

    async def recover(self) -> ChainHead | None:
        """Read the chain's head from the announce stream (after a restart, or the first start)."""
        last = await announced_head(self._bus.js, self._announce_stream, self._verifier)
        if last is not None:
            self._set_head(ChainHead(last.version, last.version_hash, last.snapshot_version,
                                     last.chain_length))  # fmt: skip
        log.info("weight chain recovered", head=self.head)
        return self.head

    async def _base_state(self) -> Mapping[str, RawTensor] | None:
        """The state of head.version: in memory, the staged file, or rebuilt from the bus."""
        if self._advancing is not None:
            advancing, self._advancing = self._advancing, None
            self._base = await advancing
        return await self._state_of(self.head)

    async def _state_of(self, head: ChainHead | None) -> Mapping[str, RawTensor] | None:
        """The state of `head` (the chain's head, or the base of the delta just announced)."""
        if self._base is not None or head is None:
            return self._base
        path = self.staging_dir / staged_file_name(head.version)
        if path.is_file():
            staged = load_staged(
                self.staging_dir,
                WeightsStaged(version=head.version, file_name=path.name,
                              num_bytes=path.stat().st_size),
            )  # fmt: skip
            if await asyncio.to_thread(state_hash, staged, self.options.threads) == head.hash:
                self._base = staged
                return staged
            log.warning("staged file does not hash to the announced version", path=str(path))
        self._base = await self._rebuild(head)
        return self._base

    async def _rebuild(self, head: ChainHead) -> dict[str, RawTensor] | None:
        """Decode head.version from the bus (latest snapshot + deltas); None if it cannot."""
        config = ReceiverConfig(decode_threads=self.options.threads, decode_process=False)
        receiver = WeightReceiver(
            self._bus, config, new_tensor_kind="raw", verifier=self._verifier,
            announce_stream=self._announce_stream, chunk_stream=self._chunk_stream,
        )  # fmt: skip
        state: dict[str, Any] = {}
        try:
            held = await receiver.catch_up(state, version=head.version, timeout_s=600.0)
        except (WeightsError, TimeoutError) as exc:
            log.error("cannot rebuild the chain head from the bus", error=repr(exc))
            return None
        finally:
            await receiver.close()
        if held.version != head.version or held.hash != head.hash:
            log.error("rebuilt state is not the chain head", held=held, head=head)
            return None
        log.info("rebuilt the chain head from the bus", version=head.version)
        return state

    # ---- handling a staged version -----------------------------------------------------

    async def on_staged(self, message: WeightsStaged, delivery: Delivery | None = None) -> None:
        """Handle one staged version (the consumer's handler; idempotent on redelivery),
        recording whether it worked for /healthz."""
        try:
            if self._superseded(message, delivery):
                return
            async with self._chain_lock:
                await self._broadcast(message)
                self._last_activity_s = time.monotonic()
        except Exception as exc:
            self.failures.failed(f"version {message.version}: {exc}")
            raise
        self.failures.succeeded()

    async def snapshot_when_idle(self, idle_s: float) -> bool:
        """Snapshot the chain's head when it is a delta and no version came for `idle_s`;
        True when one was published.

        A worker that lost a delta (its chunk gone, or refused after every read) waits for
        the next snapshot, and its tasks wait with it. When every worker is in that state
        the trainer, starved of samples, stages nothing, so the snapshot due every
        `snapshot_every` versions never comes: this one unblocks them (once per idle
        period: the head is then a snapshot)."""
        head = self.head
        if head is None or head.chain_length == 0:
            return False
        if time.monotonic() - self._last_activity_s < idle_s:
            return False
        async with self._chain_lock:
            head = self.head
            if head is None or head.chain_length == 0:
                return False
            state = await self._base_state()
            if state is None:
                log.error("idle snapshot skipped: the head's state is unavailable", head=head)
                self._last_activity_s = time.monotonic()
                return False
            log.info("no version for a while; snapshotting the head", version=head.version,
                     idle_s=round(time.monotonic() - self._last_activity_s, 1))  # fmt: skip
            await self._publish_snapshot(state, head.version)
            self._last_activity_s = time.monotonic()
        return True

    def _superseded(self, message: WeightsStaged, delivery: Delivery | None) -> bool:
        """True (and the staged file deleted) when a newer staged version is already waiting
        and this one can be skipped: it would reach the workers after the newer one was due,
        and the next delta is encoded against the last announced version anyway. The first
        version of a chain and a due snapshot are never skipped, nor a staged delta, nor a
        whole version unless a newer whole one is staged (the deltas after it build on it)."""
        head = self.head
        if delivery is None or delivery.num_pending == 0 or head is None:
            return False
        if message.version <= head.version or self._snapshot_due() or message.kind == "delta":
            return False
        if not any(v > message.version for v in staged_versions(self.staging_dir, "state")):
            return False
        (self.staging_dir / staged_file_name(message.version)).unlink(missing_ok=True)
        SUPERSEDED.inc()
        log.info("staged version superseded", version=message.version, pending=delivery.num_pending)
        return True

    async def _broadcast(self, message: WeightsStaged) -> None:
        head = self.head
        if head is not None and message.version < head.version:
            log.warning("stale staged version ignored", version=message.version, head=head.version)
            return
        if message.kind == "delta":
            await self._broadcast_staged_delta(message)
            return
        try:
            new = load_staged(self.staging_dir, message)
        except ValueError as exc:
            raise PermanentError(str(exc)) from exc
        if head is not None and message.version == head.version:
            await self._finish_announced(message.version, new)
            return
        base = await self._base_state() if head is not None else None
        if head is not None and base is not None:
            await self._publish_delta(head, base, new, message.version)
            snapshot_due = self._snapshot_due()
        else:
            if head is not None:
                log.error("chain base unavailable; starting a new chain", version=message.version)
            snapshot_due = True
        if snapshot_due:
            await self._publish_snapshot(new, message.version)
        self._base = new
        remove_staged_before(self.staging_dir, message.version)
        self.num_handled += 1

    async def _broadcast_staged_delta(self, message: WeightsStaged) -> None:
        """Store and announce a delta the trainer encoded, then bring the head's state along."""
        started = time.perf_counter()
        try:
            manifest, chunks = await asyncio.to_thread(load_staged_delta, self.staging_dir, message)
        except ValueError as exc:
            raise PermanentError(str(exc)) from exc
        head = self.head
        held = None if head is None else (head.version, head.hash)
        if held == (message.version, manifest.target_hash):
            log.info("staged delta already announced", version=message.version)
        elif head is None or held != (message.base_version, manifest.base_hash):
            holds = "nothing" if head is None else f"version {head.version} ({head.hash})"
            raise PermanentError(
                f"the staged delta of version {message.version} is on version "
                f"{message.base_version} ({manifest.base_hash}); the chain's head is {holds}: "
                "the trainer must stage the next version whole"
            )
        else:
            chain_length = head.chain_length + 1
            await self._store_and_announce(
                "delta", manifest, chunks, _model_bytes(manifest),
                time.perf_counter() - started, head.snapshot_version, chain_length,
            )  # fmt: skip
            self._set_head(ChainHead(message.version, manifest.target_hash,
                                     head.snapshot_version, chain_length))  # fmt: skip
            self._advance(head, manifest, chunks)
        if self._snapshot_due():
            base = await self._base_state()
            if base is not None:
                await self._publish_snapshot(base, message.version)
            else:
                log.error("no state for the snapshot due; the next delta tries again")
        remove_staged_before(self.staging_dir, message.version + 1)
        self.num_handled += 1

    def _advance(self, head: ChainHead, manifest: Manifest, chunks: Sequence[Chunk]) -> None:
        """Apply the delta announced on `head` to the head's state, after the deltas before
        it, in the background: the next versions need not wait for it."""
        previous, self._advancing = self._advancing, None

        async def advance() -> Mapping[str, RawTensor] | None:
            self._base = await previous if previous is not None else self._base
            base = await self._state_of(head)
            self._base = None  # it is being written
            if base is None:
                return None
            try:
                return await asyncio.to_thread(self._advanced, base, head, manifest, chunks)
            except Exception as exc:  # the bus still has it: rebuilt when needed
                log.error("cannot apply the staged delta to the head's state", error=repr(exc))
                return None

        self._advancing = asyncio.create_task(advance(), name="advance-head-state")

    def _advanced(
        self,
        base: Mapping[str, RawTensor],
        head: ChainHead,
        manifest: Manifest,
        chunks: Sequence[Chunk],
    ) -> dict[str, RawTensor]:
        """`base` (the state of `head`) with the delta applied: in place where it is a
        writable copy, else (a memory-mapped staged file) into a copy."""
        state = dict(base)
        if any(not t.data.flags.writeable for t in state.values()):
            state = {n: RawTensor(t.dtype, t.shape, t.data.copy()) for n, t in state.items()}
        applier = DeltaApplier(state, manifest, VersionInfo(version=head.version, hash=head.hash))
        applier.apply_all(chunks, threads=self.options.threads)
        applier.finish()
        return state

    async def _finish_announced(self, version: int, new: Mapping[str, RawTensor]) -> None:
        """A redelivered version that is already announced: same bytes, snapshot if due."""
        head = self.head
        assert head is not None
        got = await asyncio.to_thread(state_hash, new, self.options.threads)
        if got != head.hash:
            raise PermanentError(
                f"version {version} is already announced with hash {head.hash}; the staged "
                f"file hashes to {got}. Versions must increase: stage it as a new version"
            )
        if self._snapshot_due():
            await self._publish_snapshot(new, version)
        self._base = new
        log.info("staged version already announced", version=version)

    def _snapshot_due(self) -> bool:
        head = self.head
        return head is not None and head.chain_length >= self.snapshot_every

    async def _publish_delta(
        self,
        head: ChainHead,
        base: Mapping[str, RawTensor],
        new: Mapping[str, RawTensor],
        version: int,
    ) -> None:
        started, times = time.perf_counter(), EncodeTimes()
        if self._device_base is not None:
            manifest, chunks = await asyncio.to_thread(
                self._device_base.encode, head, base, new, version, self.options, times
            )
        else:
            manifest, chunks = await asyncio.to_thread(
                encode, base, new, base_version=head.version, version=version,
                options=self.options, base_hash=head.hash, times=times,
            )  # fmt: skip
        encode_s = time.perf_counter() - started
        chain_length = head.chain_length + 1
        await self._store_and_announce(
            "delta", manifest, chunks, _state_bytes(new), encode_s, head.snapshot_version,
            chain_length, diff_s=times.diff_s,
        )  # fmt: skip
        self._set_head(ChainHead(version, manifest.target_hash, head.snapshot_version,
                                 chain_length))  # fmt: skip

    async def _publish_snapshot(self, new: Mapping[str, RawTensor], version: int) -> None:
        started = time.perf_counter()
        manifest, chunks = await asyncio.to_thread(
            encode_snapshot, new, version=version, options=self.options
        )
        encode_s = time.perf_counter() - started
        await self._store_and_announce(
            "snapshot", manifest, chunks, _state_bytes(new), encode_s, version, 0
        )
        self._set_head(ChainHead(version, manifest.target_hash, version, 0))
        await self._purge_before(version)

    async def _store_and_announce(
        self,
        kind: WeightKind,
        manifest: Manifest,
        chunks: Sequence[Chunk],
        model_bytes: int,
        encode_s: float,
        snapshot_version: int,
        chain_length: int,
        diff_s: float = 0.0,
    ) -> None:
        max_payload = self._bus.nc.max_payload
        stored: StoredChunks = await store_chunks(self._publisher, manifest, chunks, max_payload)
        announcement = WeightAnnouncement(
            version=manifest.version,
            base_version=manifest.base_version,
            kind=kind,
            manifest=manifest,
            version_hash=manifest.target_hash,
            snapshot_version=snapshot_version,
            chain_length=chain_length,
            model_bytes=model_bytes,
            encoded_bytes=stored.num_bytes,
            encode_s=encode_s,
            created_at=time.time(),
        )
        announcement = await _signed(self._signer, self._bus.js, announcement)
        _check_fits(announcement, max_payload)
        await self._publisher.publish(
            weights_announce_subject(kind),
            announcement,
            msg_id=f"announce.{manifest.version}.{kind}.{manifest.target_hash}",
        )
        ENCODE_SECONDS.labels(kind).observe(encode_s)
        STORE_SECONDS.labels(kind).observe(stored.seconds)
        STORED_BYTES.labels(kind).inc(stored.num_bytes)
        MODEL_BYTES.labels(kind).inc(model_bytes)
        COMPRESSION_RATIO.labels(kind).set(model_bytes / max(stored.num_bytes, 1))
        log.info(
            "weight version announced",
            version=manifest.version,
            kind=kind,
            base=manifest.base_version,
            chunks=len(chunks),
            stored_mb=round(stored.num_bytes / 1e6, 3),
            ratio=round(model_bytes / max(stored.num_bytes, 1), 1),
            encode_s=round(encode_s, 3),
            diff_s=round(diff_s, 3),  # part of encode_s
            store_s=round(stored.seconds, 3),
        )

    async def _purge_before(self, version: int) -> None:
        """Delete chunks and announcements of every version before snapshot `version`."""
        kept = await purge_before_latest_snapshot(
            self._bus.js, self._verifier,
            announce_stream=self._announce_stream, chunk_stream=self._chunk_stream,
        )  # fmt: skip
        if kept is None or kept.snapshot_version != version:
            # Nothing stored for the snapshot just announced would be our bug: say so.
            log.error("cannot purge before the snapshot version", snapshot=version, kept=kept)

    def _set_head(self, head: ChainHead) -> None:
        self.head = head
        LATEST_VERSION.set(head.version)
        SNAPSHOT_VERSION.set(head.snapshot_version)
        CHAIN_LENGTH.set(head.chain_length)

    def health(self) -> dict[str, Any]:
        """Chain state for /healthz."""
        head = self.head
        return {
            "latest_version": head.version if head else None,
            "snapshot_version": head.snapshot_version if head else None,
            "chain_length": head.chain_length if head else 0,
            "snapshot_every": self.snapshot_every,
            "versions_handled": self.num_handled,
            "versions_failing": self.failures.num_failures,
        }


async def _signed(
    signer: VersionSigner | None, js: JetStreamContext, announcement: WeightAnnouncement
) -> WeightAnnouncement:
    """`announcement` signed with the trainer's policy digest (as it is without a signer)."""
    if signer is None:
        return announcement
    return signer.sign_announcement(announcement, await read_policy_digest(js))


def _check_fits(announcement: WeightAnnouncement, max_payload: int) -> None:
    size = len(msgspec.msgpack.encode(announcement))
    if size > max_payload:
        raise ValueError(
            f"the announcement of version {announcement.version} is {size} bytes, above the "
            f"server's max payload {max_payload}: raise max_chunk_bytes (fewer chunks) or "
            "the server's max_payload"
        )


def _state_bytes(state: Mapping[str, RawTensor]) -> int:
    return sum(t.data.size for t in state.values())


def _model_bytes(manifest: Manifest) -> int:
    """Bytes of the target version's tensors, from its manifest."""
    return sum(
        check_dtype(e.dtype) * int(np.prod(e.shape, dtype=np.int64)) for e in manifest.tensors
    )
