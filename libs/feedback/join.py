"""The join: each feedback event meets the served generation it rates, whichever comes first.

Inputs are the two durable consumers JOINER_GENERATIONS and JOINER_FEEDBACK; the output is
an `OnlineSample` on ROLLOUTS_ONLINE with msg id = sample id = event id. The reward mapping
is the trainer's; the joiner passes the signal through.

State lives on the bus, in the KV bucket `feedback_join` (libs/feedback/join_store.py: a
generation index, one key per waiting event, every key with a TTL), never only in memory,
so a restart (or a second joiner) picks up where the last one stopped. Work per event is
bounded: parking is one write, joining one read and (while the generation's cap fills) one
compare-and-swap of a small value, whatever else rates the same generation. The joiner
keeps what it read and wrote lately (libs/feedback/join_cache.py), so the events of a
generation it has seen cost no read, and those past a full cap no request at all.

Each handler writes its own side first and then reads the other, so when a generation and
its feedback are handled at the same moment at least one of them sees both and joins.
Both may: the sample's msg id (= event id) makes the second publish a no-op. The
generation's handler joins every waiting event, then removes their keys in one purge; an
event parked meanwhile is joined by its own handler, which re-checks the generation after
parking. An input is acked only after its effect is durable (index written, event parked,
sample or dead letter stored), and every effect is idempotent, so a crash at any point is
repaired by redelivery.

What becomes training data is capped; an event past a cap stays in the feedback stream (it
is feedback) but is not trained on, counted in `rlpipe_feedback_join_capped_total{cap}`:
- `generation`: at most `generation_sample_cap` samples per generation id (the ids
  admitted are kept in its index entry, so a redelivered event is not counted twice);
- `key`: at most `key_sample_cap` samples per API key in `key_sample_window_s` (a token
  bucket shared by every joiner, libs/feedback/rate_limit.py). Events without a key (put on
  the bus by a producer of our own) have no key cap.

Dead letters (reason "rejected", the error starting with `join: <code>:`):
- `not_eligible`: the generation is not training-eligible;
- `wrong_product`: the generation was served for another product (its metadata `product`)
  than the event names: a key may rate only its own products' generations;
- `generation_missing`: no generation arrived within `window_s` of the event's receipt;
- `generation_gone`: the index names a generation the stream no longer holds.

The sweeper (every `sweep_interval_s`) reads the waiting events, joins those whose
generation has meanwhile arrived, and dead-letters events past their window, but only while
the generation consumer has nothing undelivered: after a restart with a backlog, a
generation still in the stream must get its chance first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import structlog
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from libs.bus import wire
from libs.bus.consumer import PermanentError, PullConsumer
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.provision import ProvisionError
from libs.bus.publisher import Publisher
from libs.feedback.join_cache import JoinCache
from libs.feedback.join_store import (
    BUDGET_PREFIX,
    GenerationRef,
    Indexed,
    JoinStore,
    WaitingEvent,
)
from libs.feedback.kv_state import KvKeys
from libs.feedback.rate_limit import SharedTokenBucket
from proto import streams, subjects
from proto.messages import GENERATION_PRODUCT_KEY, FeedbackEvent, OnlineSample, ServedGeneration

log = structlog.get_logger(__name__)

BUCKET = streams.FEEDBACK_JOIN.bucket
MAX_CAS_ATTEMPTS = 20

JOINED = Counter("rlpipe_feedback_joined_total", "Online samples published by the joiner")
JOIN_DEAD = Counter(
    "rlpipe_feedback_join_dead_letters_total", "Feedback events the joiner dead-lettered", ["code"]
)
CAPPED = Counter(
    "rlpipe_feedback_join_capped_total",
    "Feedback events stored but not trained on: a sample cap (generation or key) was reached",
    ["cap"],
)
WAITING = Gauge(
    "rlpipe_feedback_join_waiting_generations",
    "Generation ids that feedback events wait for (at the last sweep)",
)

Admission = Literal["sample", "generation", "key"]


@dataclass(frozen=True)
class JoinConfig:
    """How long each side waits for the other, how often expiry is checked, and how much of
    the feedback becomes training data."""

    window_s: float = 3600.0
    sweep_interval_s: float = 30.0
    generation_sample_cap: int = 4
    key_sample_cap: int = 20_000
    key_sample_window_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.window_s < 1 or self.sweep_interval_s <= 0:
            raise ValueError(
                "join window_s must be >= 1 s (NATS per-key TTLs are whole seconds) and "
                "sweep_interval_s > 0"
            )
        if self.generation_sample_cap < 1 or self.key_sample_cap < 1:
            raise ValueError("generation_sample_cap and key_sample_cap must be >= 1")
        if self.key_sample_window_s <= 0:
            raise ValueError("key_sample_window_s must be > 0")


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
    return await bind_bucket(js, BUCKET)


async def bind_bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    """A KV bucket provisioning made; a clear error when it is missing."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        raise ProvisionError(
            f"the KV bucket {bucket} does not exist: provision the bus first (`rlpipe "
            "provision` as the admin user, or RLPIPE_PROVISION=true where the service's user "
            "may create buckets)"
        ) from None


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
        self._publisher = publisher
        self.config = config
        self._clock = clock
        keys = KvKeys(js, kv, streams.FEEDBACK_JOIN)
        self.store = JoinStore(keys, config.window_s, clock)
        self._budget = SharedTokenBucket(
            keys,
            BUDGET_PREFIX,
            rate_per_s=config.key_sample_cap / config.key_sample_window_s,
            burst=config.key_sample_cap,
            # Leased 16 at a time (a budget read and write per 16 samples, not per sample),
            # held up to a minute: a joiner that stops loses at most a minute of the budget.
            lease=16,
            lease_s=60.0,
            clock=clock,
        )
        self.cache = JoinCache(config.window_s, clock)
        # Generation ids this process is flushing: the sweeper leaves them to that flush.
        self._flushing: set[str] = set()
        self.num_joined = 0
        self.num_dead = 0
        self.num_capped = 0

    # --- handlers (run by PullConsumer: return = ack, PermanentError = dead letter) --------

    async def on_generation(self, generation: ServedGeneration, delivery: Delivery) -> None:
        gid = generation.generation_id
        if not _usable_key(gid):
            raise PermanentError(f"join: bad_id: generation_id {gid!r} cannot be a join key")
        ref = GenerationRef(
            seq=delivery.stream_sequence,
            eligible=generation.training_eligible,
            product=generation.metadata.get(GENERATION_PRODUCT_KEY, ""),
            indexed_at=self._clock(),
        )
        indexed = await self.store.index(gid, ref)  # indexed before: the first is kept
        if indexed.ref.seq == ref.seq:
            self.cache.keep_generation(ref.seq, generation)
        self.cache.keep_indexed(gid, indexed)
        await self._flush(gid, indexed)

    async def on_feedback(self, event: FeedbackEvent, delivery: Delivery) -> None:
        gid = event.generation_id
        if not _usable_key(gid):  # the API refuses these; other producers might not
            raise PermanentError(f"join: bad_id: generation_id {gid!r} cannot be a join key")
        item = WaitingEvent(
            seq=delivery.stream_sequence,
            subject=delivery.subject,
            event=event,
            parked_at=self._clock(),
        )
        indexed = None if self.cache.recently_missing(gid) else await self._indexed(gid)
        if indexed is not None:
            await self._resolve(gid, item, indexed)
            return
        await self.store.park(gid, item)
        indexed = await self._indexed(gid)  # arrived meanwhile? then we join it
        if indexed is not None:
            await self._resolve(gid, item, indexed)
            await self.store.unpark(gid, event.event_id)

    # --- the sweeper ---------------------------------------------------------------------

    async def sweep(self) -> SweepReport:
        """Join waiting events whose generation arrived; dead-letter those past the window."""
        report = SweepReport()
        waiting: dict[str, list[WaitingEvent]] = {}
        async for gid, item in self.store.all_waiting():
            waiting.setdefault(gid, []).append(item)
        report.waiting_keys = sum(map(len, waiting.values()))
        report.deferred = not await self._generations_drained()
        deadline = self._clock() - self.config.window_s
        for gid, items in waiting.items():
            indexed = await self.store.generation(gid)
            if indexed is not None and gid not in self._flushing:
                report.joined_late += await self._flush(gid, indexed)
            elif not report.deferred:
                for item in (i for i in items if i.since <= deadline):
                    await self._expire(gid, item)
                    report.expired += 1
        WAITING.set(len(waiting))
        return report

    async def _generations_drained(self) -> bool:
        spec = streams.JOINER_GENERATIONS
        try:
            info = await self._js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            return True  # nothing provisioned, nothing to wait for
        return (info.num_pending or 0) == 0

    async def _expire(self, gid: str, item: WaitingEvent) -> None:
        # Dead letter first: a crash before the removal repeats it (same id).
        window = self.config.window_s
        detail = f"no generation {gid} within {window:g} s"
        await self._dead_letter(item, "generation_missing", detail)
        await self.store.unpark(gid, item.event.event_id)

    # --- the pieces ----------------------------------------------------------------------

    async def _flush(self, gid: str, indexed: Indexed) -> int:
        """Resolve every event waiting for `gid` (join, cap or dead-letter), then drop them.
        Not compare-and-swap: an event parked after the read is joined by its own handler,
        which sees the generation when it re-checks."""
        resolved = 0
        self._flushing.add(gid)
        try:
            async for item in self.store.waiting(gid):
                indexed = await self._resolve(gid, item, indexed)
                resolved += 1
            if resolved:
                await self.store.unpark(gid)
        finally:
            self._flushing.discard(gid)
        return resolved

    async def _resolve(self, gid: str, item: WaitingEvent, indexed: Indexed) -> Indexed:
        """Join one event with its indexed generation, within the caps; returns the index as
        it is now (admitting an event changes it)."""
        ref, event = indexed.ref, item.event
        if not ref.eligible:
            await self._dead_letter(item, "not_eligible", f"generation {gid} is not eligible")
            return indexed
        if ref.product and ref.product != event.product:
            detail = f"generation {gid} was served for {ref.product!r}, not {event.product!r}"
            await self._dead_letter(item, "wrong_product", detail)
            return indexed
        admission, indexed = await self._admit(gid, event, indexed)
        if admission != "sample":
            self.num_capped += 1
            CAPPED.labels(admission).inc()
            return indexed
        generation = await self._fetch_generation(ref.seq)
        if generation is None:
            await self._dead_letter(item, "generation_gone", f"generation {gid} (seq {ref.seq})")
        else:
            await self._publish_sample(event, generation)
        return indexed

    async def _admit(
        self, gid: str, event: FeedbackEvent, indexed: Indexed
    ) -> tuple[Admission, Indexed]:
        """Whether `event` becomes a sample: under its generation's cap and its key's."""
        cap = self.config.generation_sample_cap
        budget_taken = False
        for _ in range(MAX_CAS_ATTEMPTS):
            sampled = indexed.ref.sampled
            if event.event_id in sampled:
                return "sample", indexed  # admitted before: a redelivery, or two handlers
            if len(sampled) >= cap:
                return "generation", indexed
            if event.key_name and not budget_taken:
                if await self._budget.take(event.key_name) > 0:
                    return "key", indexed
                budget_taken = True
            admitted = await self.store.add_sampled(gid, indexed, event.event_id)
            if admitted is not None:
                self.cache.keep_indexed(gid, admitted)
                return "sample", admitted
            fresh = await self.store.generation(gid)  # changed since (or a stale cache entry)
            if fresh is None:  # expired meanwhile: the window is over
                return "generation", indexed
            self.cache.keep_indexed(gid, fresh)
            indexed = fresh
        raise RuntimeError(f"join: the index of {gid} kept changing; will retry")

    async def _indexed(self, gid: str) -> Indexed | None:
        """The generation's index entry: this joiner's own, else the bus's."""
        indexed = self.cache.indexed(gid)
        if indexed is None:
            indexed = await self.store.generation(gid)
            if indexed is None:
                self.cache.keep_missing(gid)
            else:
                self.cache.keep_indexed(gid, indexed)
        return indexed

    async def _fetch_generation(self, seq: int) -> ServedGeneration | None:
        cached = self.cache.generation(seq)
        if cached is not None:
            return cached
        try:
            raw = await self._js.get_msg(streams.SERVING_GENERATIONS.name, seq=seq, direct=True)
        except NotFoundError:
            return None
        generation = wire.decode(ServedGeneration, raw.data or b"", raw.headers)
        self.cache.keep_generation(seq, generation)
        return generation

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
