"""Receive weight versions from the bus and apply them in place: the rollout-worker's side.

    receiver = WeightReceiver(bus, ReceiverConfig())    # holds nothing yet (current=None)
    while True:
        update = await receiver.next_update()             # fetched + verified, not applied
        await asyncio.to_thread(receiver.decode, update, state)   # optional, off the lock
        with engine_lock:
            pause_s = receiver.apply(update, state)       # writes only the changed elements

How it follows the chain (catch-up is derived from the streams; no request/reply, so it
works while the broadcaster is down): the receiver reads RL_WEIGHTS_ANNOUNCE with its own
ephemeral pull consumer that starts at the latest snapshot announcement (one direct get,
last by subject `rl.weights.announce.snapshot`), or at the start of the stream when there is
none. In stream order it then takes, skipping everything at or below the version it holds:
a snapshot newer than what it holds; a delta whose base is exactly what it holds (version
and hash). A delta on another base is a gap (a missed or refused version): the receiver
restarts from the latest snapshot if that is newer than what it holds, otherwise it skips
until the next snapshot. A new or late worker therefore catches up with the latest snapshot
plus the deltas after it, and a worker that is one version behind takes only the delta
(a snapshot point announces the delta first, then the snapshot).

Every announcement read is checked before it is considered: its signature against the
trainer's public keys (`signers`; libs/weights/signing.py), its place in the stream (a version
below one announced before it is a replay), and what proto.validation checks (it must say
what its manifest says; an unsigned one, where `allow_unsigned` takes those, must not be
above the newest version the trainer recorded in the state bucket). One that is unsigned,
forged, replayed, unreadable, inconsistent or implausible is dead-lettered on
`rl.dead.rl_weights_announce` with the reason (unsigned, forged, replayed, invalid, ...)
and never taken. Its chunks are then fetched by the manifest's version and
verified against the manifest's hashes, and the whole state against the version hash.

`next_update` fetches every chunk with many direct gets in flight (libs/weights/transport.py)
and raises MissingChunkError / CorruptDeltaError, applying nothing, when the version cannot
be had intact; the next call reads it again (a damaged or timed-out read, VERSION_ATTEMPTS
reads in all) or moves on (a chunk gone, or still failing).
`apply` refuses an update whose base is not the version held (BaseMismatchError), writes
the chunks in place through the codec's DeltaApplier (deltas touch only changed elements;
snapshots write into same-named tensors of the same dtype and shape), and returns the pause
in seconds (exported as rlpipe_weights_apply_pause_seconds). With `verify_full` it then
rehashes the whole state against the version hash; a mismatch raises CorruptDeltaError and
the receiver holds "unknown" until the next snapshot.

The state is a mutable mapping name -> tensor (numpy, torch, RawTensor) sharing memory
with the model, e.g. `dict(model.state_dict())` for a contiguous torch model; CUDA tensors
are patched on the GPU (libs/weights/gpu_apply.py), only changed elements crossing PCIe.
Tensors a version adds are inserted into that mapping (not a module); removed ones dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.publisher import Publisher
from libs.weights.announcements import latest_snapshot, newest_policy_version
from libs.weights.applier import DeltaApplier, PreparedChunk
from libs.weights.errors import BaseMismatchError, CorruptDeltaError, MissingChunkError
from libs.weights.format import Chunk, VersionInfo
from libs.weights.hashing import state_hash
from libs.weights.signing import ReplayGuard, VersionRefused, VersionVerifier
from libs.weights.tensors import kind_of, raw_state
from libs.weights.transport import (
    DEFAULT_ATTEMPTS,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    FetchResult,
    fetch_chunks,
)
from proto import streams
from proto.messages import WeightAnnouncement
from proto.subjects import WEIGHTS_ANNOUNCE_ALL
from proto.validation import InvalidValue, check_announcement_plausible

if TYPE_CHECKING:
    from libs.weights.decode_process import DecodeProcess

log = structlog.get_logger(__name__)

# Reads of a version refused for a timeout or a damaged chunk before it is given up (the
# rollout-worker waits between them: libs/rollout/weights_follower.py).
VERSION_ATTEMPTS = 3

APPLY_PAUSE_SECONDS = Histogram(
    "rlpipe_weights_apply_pause_seconds",
    "Time the model was paused while a version was written into it",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
FETCH_SECONDS = Histogram(
    "rlpipe_weights_fetch_seconds",
    "Time to fetch and verify every chunk of a version",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
UPDATES = Counter("rlpipe_weights_updates_total", "Weight versions by outcome", ["kind", "outcome"])
RECEIVED_VERSION = Gauge(
    "rlpipe_weights_received_version", "Policy version the receiver's model holds (-1: unknown)"
)


@dataclass
class PreparedUpdate:
    """A version whose chunks are fetched and verified, not yet applied."""

    announcement: WeightAnnouncement
    fetch: FetchResult
    # Set by WeightReceiver.decode: the applier bound to a state and its decoded chunks.
    applier: DeltaApplier | None = field(default=None, repr=False)
    decoded: list[PreparedChunk] = field(default_factory=list, repr=False)
    decoded_for: int | None = field(default=None, repr=False)  # id() of the decoded state
    # Seconds the chunks' decodes took, summed over chunks: wall time, and CPU time of the
    # threads that ran them (wall well above CPU: the decode waited, for the GIL or a lock).
    chunk_wall_s: float = 0.0
    chunk_cpu_s: float = 0.0
    decoded_in_child: bool = False  # prepared in the receiver's DecodeProcess

    @property
    def version(self) -> int:
        return self.announcement.version

    @property
    def kind(self) -> str:
        return self.announcement.kind

    @property
    def chunks(self) -> list[Chunk]:
        return self.fetch.chunks


class ReceiverConfig(BaseModel):
    """Where and how a worker receives weight versions (the rollout-worker's `weights`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str | None = Field(
        None,
        description="NATS to fetch weights from: a region's relay server "
        "(docs/weights-relay.md); unset: the service connection",
    )
    chunk_wait_s: float = Field(
        600.0,
        gt=0,
        description="With nats_url: longest wait for a version's chunks to reach the "
        "regional mirror",
    )
    fetch_parallel: int = Field(8, ge=1, description="Chunk fetches in flight")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Longest wait for one chunk")
    # A 1 GB dense bf16 delta is ~1,000 chunks: their copies, zstd and numpy release the GIL.
    decode_threads: int = Field(
        default_factory=lambda: min(8, os.cpu_count() or 1),
        ge=1,
        description="Threads decoding a version's chunks (default: up to 8, one per core)",
    )
    # In the worker's own process the decode threads wait for the GIL its event loop holds.
    decode_process: bool = Field(
        True,
        description="Decode deltas in a process of its own, against a host copy of the weights "
        "in /dev/shm (off the worker's GIL and off the GPU; the rollout-worker uses it for "
        "weights on a GPU); false: in this process's threads (also where /dev/shm cannot "
        "hold the copy)",
    )
    verify_full: bool = Field(
        True, description="Rehash the whole model after each swap (inside the pause)"
    )
    promoted_only: bool = Field(
        False, description="Apply only versions the trainer's eval gate promoted (serving)"
    )
    signers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Public keys a version must be signed with (the .pub files of `rlpipe "
        "weights keygen`, or their `ed25519:...` lines; comma-separated): several while a "
        "key is rotated",
    )
    allow_unsigned: bool = Field(
        False,
        description="Take unsigned versions too (logged): only where every publisher on the "
        "bus is trusted. Without signers and without this, the receiver refuses to start",
    )

    @field_validator("signers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """ "a.pub,b.pub" (an environment variable) -> a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value


class WeightReceiver:
    """Follows weight announcements and turns them into in-place updates of a state."""

    def __init__(
        self,
        bus: Bus,
        config: ReceiverConfig | None = None,
        *,
        current: VersionInfo | None = None,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        attempts: int = DEFAULT_ATTEMPTS,
        new_tensor_kind: str = "auto",
        announce_stream: str = streams.WEIGHTS_ANNOUNCE.name,
        chunk_stream: str = streams.WEIGHT_CHUNKS.name,
        poll_timeout_s: float = 1.0,
        verifier: VersionVerifier | None = None,
    ) -> None:
        self._bus = bus
        self.config = config or ReceiverConfig()
        # Given: the broadcaster's own key (reading its chain back); else from the config.
        self.verifier = verifier or VersionVerifier.from_config(
            self.config.signers, allow_unsigned=self.config.allow_unsigned
        )
        self._replays = ReplayGuard()
        # With config.decode_process, deltas are decoded in a process of its own
        # (libs/weights/decode_process.py), started at the first delta of a torch state;
        # snapshots (their ~1 GB of chunks would be copied through a pipe) and versions that
        # add or remove tensors are decoded here.
        self._process: DecodeProcess | None = None
        self._current = current
        self._max_in_flight_bytes = max_in_flight_bytes
        self._attempts = attempts
        self.verify_full = self.config.verify_full
        self._threads = self.config.decode_threads
        self._kind = new_tensor_kind
        self._announce_stream = announce_stream
        self._chunk_stream = chunk_stream
        self._poll_timeout_s = poll_timeout_s
        self._sub: JetStreamContext.PullSubscription | None = None
        self._next_seq: int | None = None  # where a re-created consumer resumes
        self._taken_seq: int | None = None  # the stream sequence of the last announcement read
        self._refused: tuple[int, int] | None = None  # the version last refused, its reads
        self._publisher = Publisher(bus.js)
        self._newest_known = -1  # the trainer's newest version, as last read from the KV
        self.num_refused = 0
        self.last_pause_s: float | None = None
        RECEIVED_VERSION.set(_gauge_version(current))

    @property
    def current(self) -> VersionInfo | None:
        """What the state holds, as far as this receiver knows (None: nothing or unknown)."""
        return self._current

    def reset(self, current: VersionInfo | None) -> None:
        """Declare what the state holds after the caller loaded weights some other way."""
        self._current = current
        RECEIVED_VERSION.set(_gauge_version(current))

    # ---- following announcements ---------------------------------------------------------

    async def next_update(self) -> PreparedUpdate:
        """Wait for the next version this receiver can apply and fetch it (verified).

        Raises MissingChunkError / CorruptDeltaError when that version cannot be had intact;
        nothing is applied, and the next call moves on.
        """
        while True:
            announcement = await self._next_announcement()
            if not await self._wanted(announcement):
                continue
            kind = announcement.kind
            try:
                fetched = await fetch_chunks(
                    self._bus.nc,
                    announcement.manifest,
                    stream=self._chunk_stream,
                    parallel=self.config.fetch_parallel,
                    max_in_flight_bytes=self._max_in_flight_bytes,
                    attempts=self._attempts,
                    timeout_s=self.config.fetch_timeout_s,
                )
            except CorruptDeltaError as exc:  # MissingChunkError included
                UPDATES.labels(kind, "refused").inc()
                again = await self._read_again(announcement, exc)
                log.error(
                    "weight version refused",
                    version=announcement.version,
                    kind=kind,
                    error=str(exc),
                    read_again=again,
                )
                raise
            FETCH_SECONDS.labels(kind).observe(fetched.seconds)
            log.info(
                "weight version fetched",
                version=announcement.version,
                kind=kind,
                mb=round(fetched.num_bytes / 1e6, 2),
                mb_per_s=round(fetched.mb_per_s, 1),
            )
            return PreparedUpdate(announcement, fetched)

    async def pass_over(self, wait_s: float) -> None:
        """Read what is announced within `wait_s`, taking nothing but dead-lettering a bad one
        (a worker fed another way, libs/weights/same_host.py); `reread` starts over."""
        await self._read_announcement(wait_s)

    async def reread(self) -> None:
        await self._reposition(None)

    async def _read_again(self, announcement: WeightAnnouncement, exc: CorruptDeltaError) -> bool:
        """Whether the next call reads this refused announcement again: up to VERSION_ATTEMPTS
        times unless a chunk is gone for good (MissingChunkError). Skipped, every delta after
        it is on another base, and a trainer starved of this worker's samples may never make
        the snapshot the worker would then wait for; a timeout or damaged read may pass."""
        if isinstance(exc, MissingChunkError):
            return False
        last = self._refused
        tries = last[1] + 1 if last is not None and last[0] == announcement.version else 1
        self._refused = (announcement.version, tries)
        if tries >= VERSION_ATTEMPTS or self._taken_seq is None:
            return False
        await self._reposition(self._taken_seq)
        return True

    async def _wanted(self, announcement: WeightAnnouncement) -> bool:
        """Whether to take this announcement; on a gap, reposition to the latest snapshot."""
        current = self._current
        held = current.version if current is not None else None
        if held is not None and announcement.version <= held:
            return False
        if announcement.kind == "snapshot":
            return True
        if current is not None and _is_base(announcement, current):
            return True
        snapshot = await self._latest_snapshot()
        if snapshot is not None and (held is None or snapshot[1].version > held):
            log.warning(
                "weight chain gap; catching up from the latest snapshot",
                held=held,
                delta=announcement.version,
                base=announcement.base_version,
                snapshot=snapshot[1].version,
            )
            await self._reposition(snapshot[0])
        else:
            log.warning(
                "weight delta on another base; waiting for the next snapshot",
                held=held,
                delta=announcement.version,
                base=announcement.base_version,
            )
        return False

    async def _next_announcement(self) -> WeightAnnouncement:
        """The next announcement in stream order (waits for one)."""
        while (announcement := await self._read_announcement(self._poll_timeout_s)) is None:
            pass
        return announcement

    async def _read_announcement(self, wait_s: float) -> WeightAnnouncement | None:
        """The next announcement within `wait_s` (a bad one dead-lettered: None), or None."""
        try:
            sub = await self._subscription()
            msgs = await sub.fetch(1, timeout=wait_s)
        except (nats.errors.TimeoutError, TimeoutError):  # fetch raises either
            return None
        except (nats.errors.Error, NotFoundError) as exc:
            # The server restarted or dropped our consumer: resume where we were.
            log.warning("announcement consumer lost; re-creating", error=repr(exc))
            await self._drop_subscription()
            await asyncio.sleep(self._poll_timeout_s / 2)
            return None
        msg = msgs[0]
        self._taken_seq = msg.metadata.sequence.stream
        self._next_seq = self._taken_seq + 1
        try:
            announcement = wire.decode(WeightAnnouncement, msg.data, msg.headers)
            signed = self.verifier.check_announcement(announcement)
            self._replays.check(self._taken_seq, announcement.version)
            if not signed:  # a signed version number needs no state bucket to trust it
                await self._check_plausible(announcement)
        except wire.InvalidMessage as exc:
            await self._refuse(msg, exc.reason, str(exc))
            return None
        except VersionRefused as exc:
            await self._refuse(msg, exc.reason, str(exc))
            return None
        except InvalidValue as exc:
            await self._refuse(msg, "invalid", str(exc))
            return None
        return announcement

    async def _check_plausible(self, announcement: WeightAnnouncement) -> None:
        """InvalidValue for a version above the newest the trainer recorded (re-read from
        the state bucket only when an announcement is above the last value read)."""
        if announcement.version <= self._newest_known:
            return
        newest = await newest_policy_version(self._bus.js)
        if newest is None:  # no state bucket here (a region's relay server): manifests only
            return
        self._newest_known = newest
        check_announcement_plausible(announcement, newest)

    async def _refuse(self, msg: Any, reason: str, error: str) -> None:
        """Dead-letter an announcement no receiver may take (every receiver refuses the same
        one; the dead letter's id is its stream sequence, so it is stored once)."""
        self.num_refused += 1
        UPDATES.labels("unknown", "refused").inc()
        meta = msg.metadata
        log.error("weight announcement refused", seq=meta.sequence.stream, reason=reason,
                  error=error[:300])  # fmt: skip
        headers = dict(msg.headers or {})
        delivery = Delivery(msg.subject, meta.stream, meta.sequence.stream, 1, headers)
        try:
            await publish_dead_letter(
                self._publisher, msg.data, delivery, "weight-receiver", reason, error
            )
        except Exception as exc:  # the refusal stands; only its record is missing
            log.error("dead-letter publish failed", seq=meta.sequence.stream, error=repr(exc))

    async def _subscription(self) -> JetStreamContext.PullSubscription:
        if self._sub is None:
            start = self._next_seq
            if start is None:
                snapshot = await self._latest_snapshot()
                start = snapshot[0] if snapshot is not None else None
            config = js_api.ConsumerConfig(
                deliver_policy=(
                    js_api.DeliverPolicy.BY_START_SEQUENCE if start else js_api.DeliverPolicy.ALL
                ),
                opt_start_seq=start or None,
                ack_policy=js_api.AckPolicy.NONE,
                inactive_threshold=300.0,  # an abandoned receiver's consumer goes away
                mem_storage=True,
            )
            self._sub = await self._bus.js.pull_subscribe(
                WEIGHTS_ANNOUNCE_ALL, stream=self._announce_stream, config=config
            )
        return self._sub

    async def _reposition(self, seq: int | None) -> None:
        await self._drop_subscription()
        self._next_seq = seq

    async def _drop_subscription(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _latest_snapshot(self) -> tuple[int, WeightAnnouncement] | None:
        """Stream sequence and content of the latest snapshot announcement to start from."""
        return await latest_snapshot(self._bus.js, self._announce_stream, self.verifier)

    async def close(self) -> None:
        """Stop following (the ephemeral consumer expires on the server)."""
        await self._drop_subscription()
        if self._process is not None:
            await asyncio.to_thread(self._process.close)

    # ---- applying --------------------------------------------------------------------------

    def decode(self, update: PreparedUpdate, state: MutableMapping[str, Any]) -> None:
        """Decode `update` against `state` without writing to it (blocking; a live model may
        keep serving meanwhile). `apply` does this itself when it was not done."""
        manifest = update.announcement.manifest
        child = self._decode_process(update, state)
        if child is not None and child.accepts(state, manifest):
            base = self._checked_base(update)
            assert base is not None  # a delta's base is a version held
            timings = child.prepare(state, manifest, base, update.chunks)
            update.applier, update.decoded, update.decoded_for = None, [], id(state)
            update.chunk_wall_s, update.chunk_cpu_s = timings
            update.decoded_in_child = True
            return
        applier = _applier_type(state)(
            state, update.announcement.manifest, self._checked_base(update), self._kind,
            reuse_whole=True,
        )  # fmt: skip
        prepared = applier.prepare_all(update.chunks, self._threads)
        update.applier, update.decoded, update.decoded_for = applier, prepared.chunks, id(state)
        update.chunk_wall_s, update.chunk_cpu_s = prepared.wall_s, prepared.cpu_s

    def _decode_process(
        self, update: PreparedUpdate, state: MutableMapping[str, Any]
    ) -> DecodeProcess | None:
        """The decode process for a delta of a torch state (config.decode_process), started
        at the first one; None for anything decoded here."""
        if update.kind != "delta" or not self.config.decode_process:
            return None
        if self._process is None:
            if not state or kind_of(next(iter(state.values()))) != "torch":
                return None
            from libs.weights.decode_process import DecodeProcess  # imports torch

            self._process = DecodeProcess(self._threads)
        return self._process

    def apply(self, update: PreparedUpdate, state: MutableMapping[str, Any]) -> float:
        """Write `update` into `state` in place; returns the pause in seconds (the time the
        state was being written). Blocking: run it under the engine's lock."""
        decoded = update.applier is not None or update.decoded_in_child
        if not decoded or update.decoded_for != id(state):
            self.decode(update, state)
        else:
            self._checked_base(update)
        started = time.perf_counter()
        self._current = None  # mid-write the state is neither version
        if update.decoded_in_child:
            assert self._process is not None
            held = self._process.commit(update.announcement.manifest)
        else:
            applier = update.applier
            assert applier is not None  # set by decode
            for prepared in update.decoded:
                applier.commit(prepared)
            held = applier.finish()
        pause_s = time.perf_counter() - started
        self.last_pause_s = pause_s
        APPLY_PAUSE_SECONDS.observe(pause_s)
        if self.verify_full and _state_hash(state, self._threads) != held.hash:
            UPDATES.labels(update.kind, "corrupt_after_apply").inc()
            RECEIVED_VERSION.set(-1)
            raise CorruptDeltaError(
                f"after applying version {update.version} the state does not match its hash: "
                "the state was changed outside the receiver; waiting for a snapshot"
            )
        self._current = held
        RECEIVED_VERSION.set(held.version if held.version is not None else -1)
        UPDATES.labels(update.kind, "applied").inc()
        log.info(
            "weight version applied", version=update.version, kind=update.kind, pause_s=pause_s
        )
        return pause_s

    def _checked_base(self, update: PreparedUpdate) -> VersionInfo | None:
        """The version the update applies to; BaseMismatchError if it is not what is held."""
        announcement = update.announcement
        if announcement.kind == "snapshot":
            return self._current
        if self._current is None or not _is_base(announcement, self._current):
            held = self._current.version if self._current else None
            raise BaseMismatchError(
                f"version {announcement.version} is a delta on {announcement.base_version}, "
                f"the state holds {held if held is not None else 'nothing known'}"
            )
        return self._current

    async def catch_up(
        self, state: MutableMapping[str, Any], *, version: int, timeout_s: float = 60.0
    ) -> VersionInfo:
        """Apply updates until the state holds `version` (the broadcaster's restart path)."""
        async with asyncio.timeout(timeout_s):
            while _gauge_version(self._current) < version:
                update = await self.next_update()
                await asyncio.to_thread(self.apply, update, state)
        assert self._current is not None
        return self._current


def _applier_type(state: MutableMapping[str, Any]) -> type[DeltaApplier]:
    """DeltaApplier, or its device variant for a state of GPU tensors (imports torch)."""
    if not any(kind_of(t) == "torch" and t.device.type != "cpu" for t in state.values()):
        return DeltaApplier
    from libs.weights.gpu_apply import DeviceDeltaApplier

    return DeviceDeltaApplier


def _state_hash(state: MutableMapping[str, Any], threads: int) -> str:
    """Version hash of the state; GPU tensors are hashed from one host copy each."""
    if _applier_type(state) is DeltaApplier:
        return state_hash(raw_state(state), threads)
    from libs.weights.gpu import device_state_hash

    return device_state_hash(state, threads)


def _is_base(announcement: WeightAnnouncement, current: VersionInfo) -> bool:
    """True when a delta announcement applies to what `current` describes."""
    if announcement.manifest.base_hash != current.hash:
        return False
    return current.version is None or current.version == announcement.base_version


def _gauge_version(current: VersionInfo | None) -> int:
    return -1 if current is None or current.version is None else current.version
