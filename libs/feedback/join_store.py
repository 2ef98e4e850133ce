"""The join's state in the KV bucket `feedback_join`: bounded work per event, every key a TTL.

- `gen.<generation_id>` -> GenerationRef: where the generation is stored, whether it may be
  trained on, its product, and the event ids it has admitted to training (at most the
  per-generation cap, so the value stays small however many events rate it). Created once,
  changed by compare-and-swap only while its cap fills; it expires one join window after it
  was indexed.
- `wait.<generation_id>.<event_id>` -> WaitingEvent: one key per event waiting for its
  generation, created once (appending is one write whatever waits already); they go
  together in one purge of `wait.<generation_id>.>` when the generation has been joined, or
  one by one as the sweeper expires them. A TTL of a window plus a day removes what the
  sweeper never got to (a joiner down that long; the event stays in the feedback stream).
- `budget.<key name>`: each API key's shared budget of training samples
  (libs/feedback/rate_limit.py).

Keys written before this layout: `wait.<generation_id>` holding a WaitList; the sweeper
re-parks their events one key each (`legacy_waiting`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from libs.feedback.kv_state import KvKeys
from proto.messages import FeedbackEvent

GEN_PREFIX = "gen."
WAIT_PREFIX = "wait."
BUDGET_PREFIX = "budget"
# A waiting event's key outlives its window by this much: time for a joiner that was down to
# come back, join or dead-letter it.
WAIT_GRACE_S = 24 * 3600.0


class GenerationRef(msgspec.Struct, kw_only=True):
    """Where a served generation is stored, whether it may be trained on, and for whom."""

    seq: int
    eligible: bool
    product: str = ""  # metadata[GENERATION_PRODUCT_KEY]; "" when the server recorded none
    indexed_at: float = 0.0  # Unix s; the key expires a join window after it
    sampled: list[str] = msgspec.field(default_factory=list)  # event ids admitted to training


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
    """The value of a `wait.<generation_id>` key of the layout before one key per event."""

    events: list[WaitingEvent]


@dataclass(frozen=True)
class Indexed:
    """A generation's ref as stored, with the revision a compare-and-swap names."""

    ref: GenerationRef
    revision: int


def _encode(value: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(value)


class JoinStore:
    """Reads and writes the join's keys; see the module docstring for the layout."""

    def __init__(
        self, keys: KvKeys, window_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.keys = keys
        self.window_s = window_s
        self._clock = clock

    async def index(self, gid: str, ref: GenerationRef) -> Indexed:
        """Index a generation; one indexed before (a redelivery) is kept. Returns the stored."""
        revision = await self.keys.create(GEN_PREFIX + gid, _encode(ref), ttl_s=self.window_s)
        if revision is not None:
            return Indexed(ref, revision)
        indexed = await self.generation(gid)
        return indexed if indexed is not None else Indexed(ref, 0)  # expired meanwhile

    async def generation(self, gid: str) -> Indexed | None:
        stored = await self.keys.read(GEN_PREFIX + gid)
        if stored.value is None:
            return None
        return Indexed(msgspec.msgpack.decode(stored.value, type=GenerationRef), stored.revision)

    async def add_sampled(self, gid: str, indexed: Indexed, event_id: str) -> Indexed | None:
        """Record `event_id` as admitted, if the ref is still at `indexed.revision`: the ref
        as stored now, or None when another handler changed it first."""
        ref = msgspec.structs.replace(indexed.ref, sampled=[*indexed.ref.sampled, event_id])
        now = self._clock()
        ttl_s = (ref.indexed_at or now) + self.window_s - now
        revision = await self.keys.write(
            GEN_PREFIX + gid, _encode(ref), last=indexed.revision, ttl_s=ttl_s
        )
        return None if revision is None else Indexed(ref, revision)

    async def park(self, gid: str, item: WaitingEvent) -> None:
        """Park one event (a redelivered one is parked already: kept as it is)."""
        key = f"{WAIT_PREFIX}{gid}.{item.event.event_id}"
        await self.keys.create(key, _encode(item), ttl_s=self.window_s + WAIT_GRACE_S)

    async def waiting(self, gid: str) -> AsyncIterator[WaitingEvent]:
        async for _, value in self.keys.scan(f"{WAIT_PREFIX}{gid}.>"):
            yield msgspec.msgpack.decode(value, type=WaitingEvent)

    async def all_waiting(self) -> AsyncIterator[tuple[str, WaitingEvent]]:
        """Every waiting event with its generation id; legacy wait lists are re-parked."""
        async for key, value in self.keys.scan(f"{WAIT_PREFIX}>"):
            parts = key.split(".")
            if len(parts) == 2:
                await self._repark_legacy(parts[1], value)
            elif len(parts) == 3:
                yield parts[1], msgspec.msgpack.decode(value, type=WaitingEvent)

    async def _repark_legacy(self, gid: str, value: bytes) -> None:
        for item in msgspec.msgpack.decode(value, type=WaitList).events:
            await self.park(gid, item)
        await self.keys.remove(WAIT_PREFIX + gid)

    async def unpark(self, gid: str, event_id: str | None = None) -> None:
        """Remove one waiting event, or (no event id) every event waiting for `gid`."""
        await self.keys.remove(f"{WAIT_PREFIX}{gid}.{event_id or '>'}")
