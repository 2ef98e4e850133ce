"""The join: each feedback event meets the served generation it rates, whichever comes first.

Inputs are the two durable consumers JOINER_GENERATIONS and JOINER_FEEDBACK; the output is
an `OnlineSample` on ROLLOUTS_ONLINE with msg id = sample id = event id. The reward mapping
is the trainer's; the joiner passes the signal through.

State lives on the bus, in the KV bucket `feedback_join` (file storage), never only in
memory, so a restart (or a second joiner) picks up where the last one stopped:

- `gen.<generation_id>` -> GenerationRef (its sequence in SERVING_GENERATIONS and its
  training-eligibility), created once per generation with a per-key TTL of the join window:
  feedback arriving later than that finds no generation and waits, then expires;
- `wait.<generation_id>` -> the feedback events waiting for that generation (updated with
  compare-and-swap), each with its sequence in FEEDBACK_EVENTS.

Each handler writes its own side first and then reads the other, so when a generation and
its feedback are handled at the same moment at least one of them sees both and joins.
Both may: the sample's msg id (= event id) makes the second publish a no-op. Whoever sees
the generation after a wait list changed publishes every waiting event, then purges the
key; an event appended meanwhile is joined by its own handler, which re-checks the
generation after appending. An input is acked only after its effect is durable (index
written, event parked, sample or dead letter stored), and every effect is idempotent, so a
crash at any point is repaired by redelivery.

Dead letters (reason "rejected", the error starting with `join: <code>:`):
- `not_eligible`: the generation is not training-eligible;
- `generation_missing`: no generation arrived within `window_s` of the event's receipt;
- `generation_gone`: the index names a generation the stream no longer holds.

The sweeper (every `sweep_interval_s`) lists the wait keys, joins those whose generation
has meanwhile arrived, and dead-letters events past their window, but only while the
generation consumer has nothing undelivered: after a restart with a backlog, a generation
still in the stream must get its chance first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from libs.bus import wire
from libs.bus.consumer import PermanentError, PullConsumer
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.provision import ProvisionError
from libs.bus.publisher import Publisher
from proto import streams, subjects
from proto.messages import FeedbackEvent, OnlineSample, ServedGeneration

log = structlog.get_logger(__name__)

BUCKET = streams.FEEDBACK_JOIN.bucket
GEN_PREFIX = "gen."
WAIT_PREFIX = "wait."
MAX_CAS_ATTEMPTS = 20

JOINED = Counter("rlpipe_feedback_joined_total", "Online samples published by the joiner")
JOIN_DEAD = Counter(
    "rlpipe_feedback_join_dead_letters_total", "Feedback events the joiner dead-lettered", ["code"]
)
WAITING = Gauge(
    "rlpipe_feedback_join_waiting_generations",
    "Generation ids that feedback events wait for (at the last sweep)",
)


class GenerationRef(msgspec.Struct, kw_only=True):
    """Where a served generation is stored, and whether it may be trained on."""

    seq: int
    eligible: bool


class WaitingEvent(msgspec.Struct, kw_only=True):
    """A feedback event parked until its generation arrives."""

    seq: int  # sequence in FEEDBACK_EVENTS (its dead letter's id derives from it)
    subject: str
    event: FeedbackEvent
    parked_at: float  # Unix s; the window runs from event.received_at, or this if unset

    @property
    def since(self) -> float:
        return self.event.received_at or self.parked_at


class WaitList(msgspec.Struct, kw_only=True):
    events: list[WaitingEvent]


@dataclass(frozen=True)
class JoinConfig:
    """How long each side waits for the other, and how often expiry is checked."""

    window_s: float = 3600.0
    sweep_interval_s: float = 30.0
    # A purged wait key leaves a marker; it disappears after this long.
    purge_marker_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window_s < 1 or self.sweep_interval_s <= 0 or self.purge_marker_ttl_s < 1:
            raise ValueError(
                "join window_s and purge_marker_ttl_s must be >= 1 s (NATS per-key TTLs are "
                "whole seconds) and sweep_interval_s > 0"
            )


@dataclass
class SweepReport:
    """What one sweep did."""

    waiting_keys: int = 0
    joined_late: int = 0
    expired: int = 0
    deferred: bool = False


async def setup_join_state(js: JetStreamContext) -> KeyValue:
    """The join's KV bucket (streams.FEEDBACK_JOIN). Provisioning creates it, not the
    ingester: its NATS user may read and write the bucket's keys, never create buckets."""
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        raise ProvisionError(
            f"the KV bucket {BUCKET} does not exist: provision the bus first (`rlpipe "
            "provision` as the admin user, or RLPIPE_PROVISION=true where the service's user "
            "may create buckets)"
        ) from None


def _encode(value: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(value)


class Joiner:
    """The join's handlers and sweeper; see the module docstring for the protocol."""

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        publisher: Publisher,
        config: JoinConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._kv = kv
        self._publisher = publisher
        self.config = config
        self._clock = clock
        self.num_joined = 0
        self.num_dead = 0

    # --- handlers (run by PullConsumer: return = ack, PermanentError = dead letter) --------

    async def on_generation(self, generation: ServedGeneration, delivery: Delivery) -> None:
        gid = generation.generation_id
        if not _usable_key(gid):
            raise PermanentError(f"join: bad_id: generation_id {gid!r} cannot be a join key")
        ref = GenerationRef(seq=delivery.stream_sequence, eligible=generation.training_eligible)
        with contextlib.suppress(KeyWrongLastSequenceError):  # indexed before: keep the first
            await self._kv.create(GEN_PREFIX + gid, _encode(ref), msg_ttl=self.config.window_s)
        await self._flush(gid, ref, generation)

    async def on_feedback(self, event: FeedbackEvent, delivery: Delivery) -> None:
        gid = event.generation_id
        if not _usable_key(gid):  # the API refuses these; other producers might not
            raise PermanentError(f"join: bad_id: generation_id {gid!r} cannot be a join key")
        ref = await self._generation_ref(gid)
        if ref is None:
            waiting = WaitingEvent(
                seq=delivery.stream_sequence,
                subject=delivery.subject,
                event=event,
                parked_at=self._clock(),
            )
            await self._park(gid, waiting)
            ref = await self._generation_ref(gid)  # arrived meanwhile? then we join it
            if ref is not None:
                await self._flush(gid, ref, None)
            return
        if not ref.eligible:
            JOIN_DEAD.labels("not_eligible").inc()
            raise PermanentError(f"join: not_eligible: generation {gid} is not training-eligible")
        generation = await self._fetch_generation(ref)
        if generation is None:
            JOIN_DEAD.labels("generation_gone").inc()
            raise PermanentError(f"join: generation_gone: generation {gid} (seq {ref.seq})")
        await self._publish_sample(event, generation)

    # --- the sweeper ---------------------------------------------------------------------

    async def sweep(self) -> SweepReport:
        """Join waiting events whose generation arrived; dead-letter those past the window."""
        report = SweepReport()
        keys = await self._waiting_keys()
        report.waiting_keys = len(keys)
        report.deferred = not await self._generations_drained()
        for key in keys:
            gid = key[len(WAIT_PREFIX) :]
            ref = await self._generation_ref(gid)
            if ref is not None:
                report.joined_late += await self._flush(gid, ref, None)
            elif not report.deferred:
                report.expired += await self._expire(key)
        WAITING.set(len(keys))
        return report

    async def _waiting_keys(self) -> list[str]:
        """Keys `wait.<gid>` holding a message (a value or a delete marker), in one API call
        (stream info with a subject filter; no consumer)."""
        prefix = f"$KV.{BUCKET}."
        info = await self._js.stream_info(f"KV_{BUCKET}", subjects_filter=f"{prefix}{WAIT_PREFIX}>")
        return sorted(subject[len(prefix) :] for subject in (info.state.subjects or {}))

    async def _generations_drained(self) -> bool:
        spec = streams.JOINER_GENERATIONS
        try:
            info = await self._js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            return True  # nothing provisioned, nothing to wait for
        return (info.num_pending or 0) == 0

    async def _expire(self, key: str) -> int:
        entry = await self._get(key)
        if entry is None or entry.value is None:
            return 0
        waiting = msgspec.msgpack.decode(entry.value, type=WaitList).events
        deadline = self._clock() - self.config.window_s
        expired = [w for w in waiting if w.since <= deadline]
        if not expired:
            return 0
        for item in expired:  # dead letter first: a crash before the removal repeats it (same id)
            await self._dead_letter(
                item,
                "generation_missing",
                f"no generation {item.event.generation_id} within {self.config.window_s:g} s",
            )
        kept = [w for w in waiting if w.since > deadline]
        with contextlib.suppress(KeyWrongLastSequenceError):  # changed: next sweep looks again
            if kept:
                await self._kv.update(key, _encode(WaitList(events=kept)), last=entry.revision)
            else:
                await self._kv.delete(key, last=entry.revision)
        return len(expired)

    # --- the pieces ----------------------------------------------------------------------

    async def _flush(
        self, gid: str, ref: GenerationRef, generation: ServedGeneration | None
    ) -> int:
        """Resolve every event waiting for `gid` (join or dead-letter), then drop the key."""
        key = WAIT_PREFIX + gid
        entry = await self._get(key)
        if entry is None or not entry.value:
            return 0
        waiting = msgspec.msgpack.decode(entry.value, type=WaitList).events
        if ref.eligible and generation is None:
            generation = await self._fetch_generation(ref)
        for item in waiting:
            if not ref.eligible:
                await self._dead_letter(
                    item, "not_eligible", f"generation {gid} is not training-eligible"
                )
            elif generation is None:
                await self._dead_letter(
                    item, "generation_gone", f"generation {gid} (seq {ref.seq})"
                )
            else:
                await self._publish_sample(item.event, generation)
        # Not compare-and-swap: an event appended after our read is joined by its own handler,
        # which sees the generation when it re-checks.
        await self._kv.purge(key, msg_ttl=self.config.purge_marker_ttl_s)
        return len(waiting)

    async def _park(self, gid: str, item: WaitingEvent) -> None:
        key = WAIT_PREFIX + gid
        for _ in range(MAX_CAS_ATTEMPTS):
            entry = await self._get(key)
            try:
                if entry is None or not entry.value:
                    await self._kv.create(key, _encode(WaitList(events=[item])))
                    return
                waiting = msgspec.msgpack.decode(entry.value, type=WaitList)
                if any(w.event.event_id == item.event.event_id for w in waiting.events):
                    return  # a redelivery: parked already
                waiting.events.append(item)
                await self._kv.update(key, _encode(waiting), last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue  # another handler changed it: read again
        raise RuntimeError(f"join: wait list of {gid} kept changing; will retry")

    async def _generation_ref(self, gid: str) -> GenerationRef | None:
        entry = await self._get(GEN_PREFIX + gid)
        if entry is None or not entry.value:
            return None
        return msgspec.msgpack.decode(entry.value, type=GenerationRef)

    async def _get(self, key: str) -> KeyValue.Entry | None:
        try:
            return await self._kv.get(key)
        except KeyNotFoundError:  # absent, deleted, purged or expired
            return None

    async def _fetch_generation(self, ref: GenerationRef) -> ServedGeneration | None:
        try:
            raw = await self._js.get_msg(streams.SERVING_GENERATIONS.name, seq=ref.seq)
        except NotFoundError:
            return None
        return wire.decode(ServedGeneration, raw.data or b"", raw.headers)

    async def _publish_sample(self, event: FeedbackEvent, generation: ServedGeneration) -> None:
        sample = OnlineSample(
            sample_id=event.event_id, generation=generation, feedback=event, joined_at=self._clock()
        )
        ack = await self._publisher.publish(subjects.ROLLOUTS_ONLINE, sample, msg_id=event.event_id)
        if not ack.duplicate:
            self.num_joined += 1
            JOINED.inc()

    async def _dead_letter(self, item: WaitingEvent, code: str, detail: str) -> None:
        delivery = Delivery(
            subject=item.subject,
            stream=streams.FEEDBACK_EVENTS.name,
            stream_sequence=item.seq,
            num_delivered=1,
            headers=wire.headers_for(item.event, item.event.event_id),
        )
        await publish_dead_letter(
            self._publisher,
            wire.encode(item.event),
            delivery,
            streams.JOINER_FEEDBACK.durable,
            "rejected",
            f"join: {code}: {detail}",
        )
        self.num_dead += 1
        JOIN_DEAD.labels(code).inc()
        log.warning(
            "feedback dead-lettered", code=code, event_id=item.event.event_id, detail=detail
        )


def _usable_key(gid: str) -> bool:
    return 0 < len(gid) <= 128 and all(c.isascii() and (c.isalnum() or c in "-_") for c in gid)


class JoinRunner:
    """Runs the joiner: both consumers and the sweeper, until stopped."""

    def __init__(
        self,
        joiner: Joiner,
        js: JetStreamContext,
        publisher: Publisher,
        *,
        batch_size: int = 64,
        concurrency: int = 16,
        fetch_timeout_s: float = 1.0,
    ) -> None:
        self.joiner = joiner
        self.generations: PullConsumer[ServedGeneration] = PullConsumer(
            js,
            streams.JOINER_GENERATIONS,
            ServedGeneration,
            joiner.on_generation,
            publisher,
            batch_size=batch_size,
            concurrency=concurrency,
            fetch_timeout_s=fetch_timeout_s,
        )
        self.feedback: PullConsumer[FeedbackEvent] = PullConsumer(
            js,
            streams.JOINER_FEEDBACK,
            FeedbackEvent,
            joiner.on_feedback,
            publisher,
            batch_size=batch_size,
            concurrency=concurrency,
            fetch_timeout_s=fetch_timeout_s,
        )
        self._stopping = asyncio.Event()
        self.last_sweep: SweepReport | None = None

    async def run(self) -> None:
        """Until `stop`; a consumer or sweeper that crashes takes the runner down."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.generations.run(), name="join.generations")
            group.create_task(self.feedback.run(), name="join.feedback")
            group.create_task(self._sweep_loop(), name="join.sweeper")

    async def _sweep_loop(self) -> None:
        interval_s = self.joiner.config.sweep_interval_s
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=interval_s)
            if self._stopping.is_set():
                return
            try:
                self.last_sweep = await self.joiner.sweep()
            except Exception as exc:  # the bus blinked: the next sweep tries again
                log.warning("join sweep failed", error=repr(exc))
                continue
            if self.last_sweep.deferred and self.last_sweep.waiting_keys:
                log.info("join expiry deferred: generation backlog not drained")

    async def stop(self, grace_s: float) -> None:
        self._stopping.set()
        await asyncio.gather(self.generations.stop(grace_s), self.feedback.stop(grace_s))
