"""Publishing to JetStream: dedup ids, schema headers, pipelined with bounded in-flight.

`publish` waits for the stream's acknowledgement (the message is durable when it returns);
`publish_many` pipelines a batch with at most `max_in_flight` unacknowledged at a time.
A publish whose ack does not come in time is retried with the same `Nats-Msg-Id`, so the
stream stores it once even if the first attempt did land; it gives up after `max_attempts`
attempts and `retry_window_s` seconds both (a stream electing a leader answers "no
responders" at once for a while), raising PublishError.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from prometheus_client import Counter

from libs.bus import wire
from proto.messages import Message

log = structlog.get_logger(__name__)

PUBLISHED = Counter(
    "rlpipe_bus_published_messages_total", "Messages acknowledged by a stream", ["subject_root"]
)
PUBLISH_RETRIES = Counter(
    "rlpipe_bus_publish_retries_total", "Publishes retried after an ack timeout or error"
)


# How long a publish keeps being retried (besides `max_attempts`): a stream whose leader died
# answers "no responders" at once until its replicas elect a new one, which took over a second
# on a loaded 2-core machine: five quick attempts (1.5 s) ran out in the middle of it, the
# trainer's staged version was lost and the 3-node cluster demo hung.
RETRY_WINDOW_S = 30.0


class PublishError(RuntimeError):
    """A message could not be stored after every retry."""


@dataclass(frozen=True)
class Outgoing:
    """One message to publish: where, what, and the id that makes retries safe."""

    subject: str
    message: Message
    msg_id: str


class InFlightWindow:
    """Bounds unacknowledged publishes by count and by bytes, first come first served.

    The byte bound matters for large messages: since 2.11 a stream buffers about 128 MB of
    pending writes and then rejects publishes, so 256 messages of 1 MB must not be in flight.
    One message larger than the byte bound still goes, alone.
    """

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("max_in_flight and max_in_flight_bytes must be >= 1")
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._messages = 0
        self._bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, num_bytes: int) -> None:
        if not self._waiters and self._fits(num_bytes):
            self._take(num_bytes)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((num_bytes, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(num_bytes)  # granted just as we were cancelled: give it back
            raise

    def release(self, num_bytes: int) -> None:
        self._messages -= 1
        self._bytes -= num_bytes
        while self._waiters and self._fits(self._waiters[0][0]):
            waiting_bytes, granted = self._waiters.popleft()
            if not granted.done():
                self._take(waiting_bytes)
                granted.set_result(None)

    def _fits(self, num_bytes: int) -> bool:
        if self._messages == 0:
            return True
        return self._messages < self._max_messages and self._bytes + num_bytes <= self._max_bytes

    def _take(self, num_bytes: int) -> None:
        self._messages += 1
        self._bytes += num_bytes


class Publisher:
    """Publishes typed messages with bounded in-flight acks and bounded retries."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        max_in_flight: int = 256,
        max_in_flight_bytes: int = 32 * 1024 * 1024,
        ack_timeout_s: float = 5.0,
        max_attempts: int = 5,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        self._js = js
        self._window = InFlightWindow(max_in_flight, max_in_flight_bytes)
        self._ack_timeout_s = ack_timeout_s
        self._max_attempts = max_attempts
        self._retry_window_s = retry_window_s
        self._published: dict[str, Any] = {}  # subject -> its counter child, to skip .labels()

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context published through."""
        return self._js

    async def publish(self, subject: str, message: Message, msg_id: str) -> js_api.PubAck:
        """Publish one message and wait until the stream has stored it."""
        payload = wire.encode(message)
        return await self._send_with_retries(subject, payload, wire.headers_for(message, msg_id))

    async def publish_many(self, items: Iterable[Outgoing]) -> list[js_api.PubAck]:
        """Publish many, pipelined through the in-flight window; returns acks in order.

        Messages are encoded as the window admits them, so a large batch is never all in
        memory twice. Acks that fail or do not come in time are retried one by one with the
        same msg id; raises PublishError if one fails for good.
        """
        sent: list[tuple[str, bytes, dict[str, str], asyncio.Future[js_api.PubAck]]] = []
        for item in items:
            payload = wire.encode(item.message)
            headers = wire.headers_for(item.message, item.msg_id)
            sent.append(
                (
                    item.subject,
                    payload,
                    headers,
                    await self._start_send(item.subject, payload, headers),
                )
            )
        if sent:
            await asyncio.wait([future for *_, future in sent], timeout=self._ack_timeout_s)
        return [await self._ack_or_retry(*entry) for entry in sent]

    async def publish_raw(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> js_api.PubAck:
        """Publish bytes as they are (dead letters re-publish a payload we cannot decode).

        `headers` must carry a Nats-Msg-Id for retries to be safe.
        """
        if wire.MSG_ID_HEADER not in headers:
            raise ValueError("publish_raw needs a Nats-Msg-Id header so retries are not duplicates")
        return await self._send_with_retries(subject, payload, headers)

    async def _start_send(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[js_api.PubAck]:
        """Send once; the future holds the ack and frees the window slot when it resolves."""
        await self._window.acquire(len(payload))
        try:
            future = await self._js.publish_async(subject, payload, headers=dict(headers))
        except BaseException:
            self._window.release(len(payload))
            raise
        future.add_done_callback(lambda _: self._window.release(len(payload)))
        return future

    async def _ack_or_retry(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        future: asyncio.Future[js_api.PubAck],
    ) -> js_api.PubAck:
        if future.done() and not future.cancelled() and future.exception() is None:
            self._count(subject)
            return future.result()
        future.cancel()  # no ack in time: nats-py's future has no deadline of its own
        return await self._send_with_retries(subject, payload, headers, first_attempt=2)

    async def _send_with_retries(
        self, subject: str, payload: bytes, headers: dict[str, str], first_attempt: int = 1
    ) -> js_api.PubAck:
        if first_attempt > self._max_attempts:
            raise PublishError(f"publish to {subject}: no attempts allowed (max_attempts)")
        delay_s = 0.1
        started_s = time.monotonic()
        attempt = first_attempt
        while True:
            try:
                future = await self._start_send(subject, payload, headers)
                ack = await asyncio.wait_for(future, timeout=self._ack_timeout_s)
            except Exception as exc:  # timeouts, no responders, 503 while the server restarts
                elapsed_s = time.monotonic() - started_s
                if attempt >= self._max_attempts and elapsed_s >= self._retry_window_s:
                    raise PublishError(
                        f"publish to {subject} failed after {attempt} attempts in "
                        f"{elapsed_s:.1f} s: {exc!r}"
                    ) from exc
                PUBLISH_RETRIES.inc()
                log.warning("publish retry", subject=subject, attempt=attempt, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
                attempt += 1
                continue
            self._count(subject)
            return ack

    def _count(self, subject: str) -> None:
        counter = self._published.get(subject)
        if counter is None:
            counter = PUBLISHED.labels(subject_root=".".join(subject.split(".")[:2]))
            self._published[subject] = counter
        counter.inc()
