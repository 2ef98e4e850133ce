"""Reading a stream in order from a sequence the reader keeps itself (no server-side acks).

For a consumer whose progress must be part of its own checkpoint (the trainer): it stores
how far it consumed, and after a restart reads again from there. The server-side consumer
is ephemeral, acks nothing, and is recreated from the last sequence seen when it is lost.
Undecodable or invalid messages are dead-lettered and returned as `skipped` so the owner
can count them as consumed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from libs.bus import wire
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.publisher import Publisher
from proto.messages import Message

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class StreamRecord(Generic[M]):
    """One message read: its stream sequence and the decoded message."""

    sequence: int
    message: M


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

    async def read(self, max_messages: int, timeout_s: float) -> list[StreamRecord[M]]:
        """Up to `max_messages` decoded messages in stream order; [] when none came in time."""
        sub = await self._subscription()
        try:
            msgs = await sub.fetch(max_messages, timeout=timeout_s)
        except (nats.errors.TimeoutError, TimeoutError):  # fetch raises either
            return []
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("stream read failed; recreating the consumer", error=repr(exc))
            await self.close()
            return []
        records = []
        for msg in msgs:
            record = await self._decode(msg)
            self._next_sequence = msg.metadata.sequence.stream + 1
            if record is not None:
                records.append(record)
        return records

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
