"""What one API key sent, everywhere it is stored, and removing it (`rlpipe feedback-events`).

Every event the API stores carries its key's name and id (FeedbackEvent.key_name, key_id),
and so does every copy made of it: the feedback stream, the join's waiting events (the KV
bucket feedback_join), the online samples (whose `feedback` is the event) and the join's
dead letters (whose payload is the event). A leaked key's events are found by reading each
of them, and removed message by message:

    selector = KeySelector.parse("acme-web")          # or "acme-web:9f86d081884c" (one key)
    found = await find_key_events(js, selector)       # counts per place, products, times
    removed = await purge_key_events(js, selector)    # the same, deleted

Samples already trained on stay in the model (a purge cannot untrain); those the trainer
has not reached yet are gone before it reads them. A purge while the joiner runs may miss a
sample it is publishing at that moment: purge again (a second pass finds nothing or that).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.stream_scan import scan_stream
from libs.feedback.join import BUCKET, bind_bucket
from libs.feedback.join_store import WAIT_PREFIX, WaitingEvent
from libs.feedback.kv_state import KvKeys
from proto import streams, subjects
from proto.messages import DeadLetter, FeedbackEvent, Message, OnlineSample

DELETES_IN_FLIGHT = 64

M = TypeVar("M", bound=Message)
T = TypeVar("T")


@dataclass(frozen=True)
class KeySelector:
    """An API key by name (all its keys: rotations share a name), or one key by its id."""

    name: str
    key_id: str = ""

    @classmethod
    def parse(cls, text: str) -> KeySelector:
        name, _, key_id = text.partition(":")
        if not name:
            raise ValueError(f"--key {text!r}: give NAME or NAME:KEY_ID")
        return cls(name, key_id)

    def matches(self, event: FeedbackEvent) -> bool:
        return event.key_name == self.name and (
            not self.key_id or event.key_id.startswith(self.key_id)
        )

    def __str__(self) -> str:
        return f"{self.name}:{self.key_id}" if self.key_id else self.name


@dataclass
class KeyEvents:
    """Where one key's events are: stream sequences and waiting keys, with a summary."""

    events: list[int] = field(default_factory=list)  # in RL_FEEDBACK_EVENTS
    waiting: list[str] = field(default_factory=list)  # keys of feedback_join
    samples: list[int] = field(default_factory=list)  # in RL_ROLLOUTS_ONLINE
    dead_letters: list[int] = field(default_factory=list)  # in RL_DEAD_LETTERS
    products: Counter[str] = field(default_factory=Counter)
    key_ids: Counter[str] = field(default_factory=Counter)
    first_received_at: float = 0.0
    last_received_at: float = 0.0

    def counts(self) -> dict[str, int]:
        return {
            "events": len(self.events),
            "waiting": len(self.waiting),
            "samples": len(self.samples),
            "dead_letters": len(self.dead_letters),
        }

    @property
    def total(self) -> int:
        return sum(self.counts().values())

    def note(self, event: FeedbackEvent) -> None:
        self.products[event.product] += 1
        self.key_ids[event.key_id] += 1
        at = event.received_at
        self.first_received_at = min(self.first_received_at or at, at)
        self.last_received_at = max(self.last_received_at, at)


async def find_key_events(js: JetStreamContext, selector: KeySelector) -> KeyEvents:
    """Every stored copy of the events `selector`'s key sent."""
    found = KeyEvents()
    async for seq, event in _messages_in(
        js, streams.FEEDBACK_EVENTS.name, subjects.FEEDBACK_EVENTS, FeedbackEvent
    ):
        if selector.matches(event):
            found.events.append(seq)
            found.note(event)
    keys = KvKeys(js, await bind_bucket(js, BUCKET), streams.FEEDBACK_JOIN)
    async for key, value in keys.scan(f"{WAIT_PREFIX}*.*"):
        if selector.matches(msgspec.msgpack.decode(value, type=WaitingEvent).event):
            found.waiting.append(key)
    async for seq, sample in _messages_in(
        js, streams.ROLLOUTS_ONLINE.name, subjects.ROLLOUTS_ONLINE, OnlineSample
    ):
        if selector.matches(sample.feedback):
            found.samples.append(seq)
    dead_subject = subjects.dead_letter_subject(streams.FEEDBACK_EVENTS.name)
    async for seq, letter in _messages_in(js, streams.DEAD_LETTERS.name, dead_subject, DeadLetter):
        payload = _decoded(FeedbackEvent, letter.payload, letter.headers)
        if payload is not None and selector.matches(payload):
            found.dead_letters.append(seq)
    return found


async def purge_key_events(js: JetStreamContext, selector: KeySelector) -> KeyEvents:
    """Delete every stored copy of `selector`'s events; returns what was deleted. The
    feedback stream first, so the joiner starts nothing new from them."""
    found = await find_key_events(js, selector)
    await _delete_all(js, streams.FEEDBACK_EVENTS.name, found.events)
    keys = KvKeys(js, await bind_bucket(js, BUCKET), streams.FEEDBACK_JOIN)
    await _each(found.waiting, keys.remove)
    await _delete_all(js, streams.ROLLOUTS_ONLINE.name, found.samples)
    await _delete_all(js, streams.DEAD_LETTERS.name, found.dead_letters)
    return found


async def _messages_in(
    js: JetStreamContext, stream: str, subject: str, message_type: type[M]
) -> AsyncIterator[tuple[int, M]]:
    """The decodable messages of `stream` on `subject` (others are not an event of a key)."""
    async for msg in scan_stream(js, stream, subject):
        message = _decoded(message_type, msg.data, msg.headers)
        if message is not None:
            yield msg.metadata.sequence.stream, message


def _decoded(message_type: type[M], data: bytes, headers: dict[str, str] | None) -> M | None:
    try:
        return wire.decode(message_type, data, headers)
    except wire.InvalidMessage:
        return None


async def _delete_all(js: JetStreamContext, stream: str, sequences: list[int]) -> None:
    async def delete(seq: int) -> None:
        # Gone meanwhile (its age, the stream's limit): as good as deleted.
        with contextlib.suppress(NotFoundError):
            await js.delete_msg(stream, seq)

    await _each(sequences, delete)


async def _each(items: list[T], action: Callable[[T], Awaitable[None]]) -> None:
    """`action` on every item, DELETES_IN_FLIGHT at a time."""
    for start in range(0, len(items), DELETES_IN_FLIGHT):
        await asyncio.gather(*(action(item) for item in items[start : start + DELETES_IN_FLIGHT]))
