"""Publishing to JetStream: dedup ids, schema headers, pipelined with bounded in-flight.

`publish` waits for the stream's acknowledgement (the message is durable when it returns);
`publish_many` pipelines a batch with at most `max_in_flight` unacknowledged at a time.
A publish whose ack does not come in time is retried with the same `Nats-Msg-Id`, so the
stream stores it once even if the first attempt did land.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from prometheus_client import Counter, Histogram

from libs.bus import wire
from proto.messages import Message

log = structlog.get_logger(__name__)

PUBLISHED = Counter(
    "rlpipe_bus_published_messages_total", "Messages acknowledged by a stream", ["subject_root"]
)
PUBLISH_RETRIES = Counter(
    "rlpipe_bus_publish_retries_total", "Publishes retried after an ack timeout or error"
)
PUBLISH_SECONDS = Histogram(
    "rlpipe_bus_publish_ack_seconds", "Time from publish to stream acknowledgement"
)


class PublishError(RuntimeError):
    """A message could not be stored after every retry."""


@dataclass(frozen=True)
class Outgoing:
    """One message to publish: where, what, and the id that makes retries safe."""

    subject: str
    message: Message
    msg_id: str


class Publisher:
    """Publishes typed messages with bounded in-flight acks and bounded retries."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        max_in_flight: int = 256,
        ack_timeout_s: float = 5.0,
        max_attempts: int = 5,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._js = js
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._ack_timeout_s = ack_timeout_s
        self._max_attempts = max_attempts

    async def publish(self, subject: str, message: Message, msg_id: str) -> js_api.PubAck:
        """Publish one message and wait until the stream has stored it."""
        return await self._publish_with_retries(Outgoing(subject, message, msg_id))

    async def publish_many(self, items: Iterable[Outgoing]) -> list[js_api.PubAck]:
        """Publish many, pipelined; returns acks in order, raises if any failed for good."""
        tasks = [asyncio.create_task(self._publish_with_retries(item)) for item in items]
        return list(await asyncio.gather(*tasks))

    async def publish_raw(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> js_api.PubAck:
        """Publish bytes as they are (dead letters re-publish a payload we cannot decode).

        `headers` must carry a Nats-Msg-Id for retries to be safe.
        """
        if wire.MSG_ID_HEADER not in headers:
            raise ValueError("publish_raw needs a Nats-Msg-Id header so retries are not duplicates")
        return await self._send_with_retries(subject, payload, headers)

    async def _publish_with_retries(self, item: Outgoing) -> js_api.PubAck:
        payload = wire.encode(item.message)
        headers = wire.headers_for(item.message, item.msg_id)
        return await self._send_with_retries(item.subject, payload, headers)

    async def _send_with_retries(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> js_api.PubAck:
        delay_s = 0.1
        for attempt in range(1, self._max_attempts + 1):
            try:
                ack = await self._send_once(subject, payload, headers)
            except Exception as exc:  # timeouts, no responders, 503 while the server restarts
                if attempt == self._max_attempts:
                    raise PublishError(
                        f"publish to {subject} failed after {attempt} attempts: {exc!r}"
                    ) from exc
                PUBLISH_RETRIES.inc()
                log.warning("publish retry", subject=subject, attempt=attempt, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
                continue
            PUBLISHED.labels(subject_root=".".join(subject.split(".")[:2])).inc()
            return ack
        raise AssertionError("unreachable: the loop returns or raises")

    async def _send_once(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> js_api.PubAck:
        async with self._in_flight:
            with PUBLISH_SECONDS.time():
                future = await self._js.publish_async(subject, payload, headers=dict(headers))
                # nats-py's future has no deadline of its own: a lost ack would hang forever.
                return await asyncio.wait_for(future, timeout=self._ack_timeout_s)
