"""Reading a stream in order from a sequence the reader keeps itself (no server-side acks).

For a consumer whose progress must be part of its own checkpoint (the trainer): it stores
how far it consumed, and after a restart reads again from there. The server-side consumer
is ephemeral, acks nothing, and is recreated from the last sequence seen when it is lost.
Undecodable or invalid messages (libs.bus.wire, proto.validation) are dead-lettered and
their sequences returned in `StreamRead.skipped`, so the owner counts them as consumed; a
message the owner refuses after decoding (a check that needs its own state) goes the same
way through `refuse`. Nothing read is dropped without a dead letter.

    reader = StreamReader(js, stream, subject, ScoredRollout, publisher, start_sequence=n)
    read = await reader.read(256, timeout_s=0.5)
    read.records, read.skipped       # decoded, in order; sequences dead-lettered
    await reader.refuse(record, "token id 70000 outside the vocabulary")
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from prometheus_client import Counter

from libs.bus import wire
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.publisher import Publisher
from proto.messages import Message

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)

DEAD_LETTERED = Counter(
    "rlpipe_bus_reader_dead_letters_total",
    "Messages a stream reader dead-lettered (undecodable, invalid, refused by its owner)",
    ["reader", "reason"],
)


@dataclass(frozen=True)
class StreamRecord(Generic[M]):
    """One message read: its stream sequence and the decoded message."""

    sequence: int
    message: M


@dataclass
class StreamRead(Generic[M]):
    """What one read returned: decoded records, and the sequences it dead-lettered."""

    records: list[StreamRecord[M]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


class StreamReader(Generic[M]):
    """Reads `stream` (filtered by `subject`) in order, starting at `start_sequence`."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subject: str,
        message_type: type[M],
        publisher: Publisher,
        *,
        start_sequence: int = 1,
        reader_name: str = "reader",
    ) -> None:
        self._js = js
        self._stream = stream
        self._subject = subject
        self._type = message_type
        self._publisher = publisher
        self._next_sequence = max(1, start_sequence)
        self._name = reader_name
        self._sub: JetStreamContext.PullSubscription | None = None
        self.num_skipped = 0

    @property
    def next_sequence(self) -> int:
        """The sequence the next read starts from."""
        return self._next_sequence

    async def read(self, max_messages: int, timeout_s: float) -> StreamRead[M]:
        """Up to `max_messages` messages in stream order, decoded or dead-lettered; nothing
        when none came in time."""
        read: StreamRead[M] = StreamRead()
        try:
            sub = await self._subscription()
            msgs = await sub.fetch(max_messages, timeout=timeout_s)
        except (nats.errors.TimeoutError, TimeoutError):  # fetch raises either
            return read
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("stream read failed; recreating the consumer", error=repr(exc))
            await self.close()
            return read
        for msg in msgs:
            if msg.metadata.sequence.stream < self._next_sequence:
                # Delivered before: a consumer re-created after a NATS restart sent part of
                # what we had read again. Each sequence reaches the owner once.
                continue
            record = await self._decode(msg)
            self._next_sequence = msg.metadata.sequence.stream + 1
            if record is None:
                read.skipped.append(msg.metadata.sequence.stream)
            else:
                read.records.append(record)
        return read

    async def refuse(self, record: StreamRecord[M], error: str, reason: str = "invalid") -> None:
        """Dead-letter a decoded message its owner cannot use (`reason`: "invalid", or
        "rejected" for one valid but unwanted, e.g. a duplicate); the payload stored is the
        message re-encoded. Raises if it could not be stored."""
        payload = wire.encode(record.message)
        headers = {wire.SCHEMA_HEADER: record.message.schema_id()}
        delivery = Delivery(self._subject, self._stream, record.sequence, 1, headers)
        await publish_dead_letter(self._publisher, payload, delivery, self._name, reason, error)
        self.num_skipped += 1
        DEAD_LETTERED.labels(self._name, reason).inc()
        log.warning("dead-lettered", reader=self._name, seq=record.sequence, error=error[:200])

    async def _decode(self, msg: Msg) -> StreamRecord[M] | None:
        headers = dict(msg.headers or {})
        try:
            message = wire.decode(self._type, msg.data, headers)
        except wire.InvalidMessage as exc:
            meta = msg.metadata
            delivery = Delivery(msg.subject, meta.stream, meta.sequence.stream, 1, headers)
            await publish_dead_letter(
                self._publisher, msg.data, delivery, self._name, exc.reason, str(exc)
            )
            self.num_skipped += 1
            DEAD_LETTERED.labels(self._name, exc.reason).inc()
            log.warning(
                "dead-lettered", reader=self._name, seq=meta.sequence.stream, reason=exc.reason
            )
            return None
        return StreamRecord(msg.metadata.sequence.stream, message)

    async def _subscription(self) -> JetStreamContext.PullSubscription:
        if self._sub is None:
            config = js_api.ConsumerConfig(
                deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self._next_sequence,
                ack_policy=js_api.AckPolicy.NONE,
                # The server removes the consumer after this long without a fetch.
                inactive_threshold=300.0,
            )
            self._sub = await self._js.pull_subscribe(
                self._subject,
                stream=self._stream,
                config=config,
                pending_bytes_limit=256 * 1024 * 1024,
            )
        return self._sub

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
