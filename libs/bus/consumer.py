"""Pull consumption: batched fetch, ack after success, nak with backoff, dead-letter.

For each delivered message:
- undecodable, invalid or of another schema: dead-lettered at once, then acked;
- the handler returns: acked;
- the handler raises `PermanentError`: dead-lettered ("rejected"), then acked;
- the handler raises anything else: nak'd with a growing delay, and dead-lettered
  ("max_deliver") on the spec's last attempt;
- delivered once more than the spec allows (the handler never returned, e.g. the process
  died): dead-lettered ("max_deliver").
A message is acked only after its effect (or its dead letter) is durable, so nothing is
lost; while a handler works, in-progress acks keep the server from redelivering it.
A fetch that fails because the server is away (restarting) is retried for up to
`BUS_AWAY_LIMIT_S` while nats-py reconnects, so a NATS restart costs no process restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter, Histogram

from libs.bus import wire
from libs.bus.dead_letter import Delivery, publish_dead_letter
from libs.bus.publisher import Publisher
from proto.messages import Message
from proto.streams import ConsumerSpec

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)

HANDLED = Counter(
    "rlpipe_bus_handled_messages_total", "Messages by outcome", ["consumer", "outcome"]
)
HANDLER_SECONDS = Histogram(
    "rlpipe_bus_handler_seconds", "Time a handler took per message", ["consumer"]
)

DEFAULT_BACKOFF_S = (0.5, 2.0, 5.0, 15.0, 30.0)
# How long fetches may keep failing (the server away) before the consumer gives up loudly.
BUS_AWAY_LIMIT_S = 120.0


class PermanentError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it now."""


Handler = Callable[[M, Delivery], Awaitable[None]]


def backoff_delay_s(num_delivered: int, schedule: tuple[float, ...] = DEFAULT_BACKOFF_S) -> float:
    """Redelivery delay after the `num_delivered`-th failed attempt."""
    return schedule[min(num_delivered, len(schedule)) - 1]


class PullConsumer(Generic[M]):
    """Runs `handler` on every message of a durable pull consumer until stopped."""

    def __init__(
        self,
        js: JetStreamContext,
        spec: ConsumerSpec,
        message_type: type[M],
        handler: Handler[M],
        publisher: Publisher,
        *,
        batch_size: int = 64,
        concurrency: int = 64,
        fetch_timeout_s: float = 1.0,
        backoff_s: tuple[float, ...] = DEFAULT_BACKOFF_S,
    ) -> None:
        self._js = js
        self.spec = spec
        self._type = message_type
        self._handler = handler
        self._publisher = publisher
        self._batch_size = batch_size
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._fetch_timeout_s = fetch_timeout_s
        self._backoff_s = backoff_s
        self._stopping = asyncio.Event()
        self._failing_since: float | None = None
        self._in_flight: dict[asyncio.Task[None], Msg] = {}
        self.num_handled = 0
        self._acked = HANDLED.labels(spec.durable, "acked")
        self._handler_seconds = HANDLER_SECONDS.labels(spec.durable)

    async def run(self) -> None:
        """Fetch and handle until `stop` is called."""
        sub = await self._js.pull_subscribe_bind(
            durable=self.spec.durable,
            stream=self.spec.stream,
            # Large messages (rollouts with long token lists) must not trip the slow-consumer limit.
            pending_bytes_limit=256 * 1024 * 1024,
        )
        keep_alive = asyncio.create_task(self._keep_alive())
        try:
            while not self._stopping.is_set():
                await self._fetch_and_dispatch(sub)
        finally:
            keep_alive.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _fetch_and_dispatch(self, sub: JetStreamContext.PullSubscription) -> None:
        await self._slots.acquire()
        self._slots.release()
        free = max(1, self._concurrency - len(self._in_flight))
        try:
            msgs = await sub.fetch(min(self._batch_size, free), timeout=self._fetch_timeout_s)
        except (nats.errors.TimeoutError, TimeoutError):  # fetch raises either
            self._failing_since = None
            return
        except nats.errors.Error as exc:  # the server is away: nats-py is reconnecting
            await self._bus_away(exc)
            return
        self._failing_since = None
        for msg in msgs:
            await self._slots.acquire()
            if self._stopping.is_set():  # fetched as `stop` began: handed back at once
                self._slots.release()
                with contextlib.suppress(Exception):
                    await msg.nak()
                continue
            task = asyncio.create_task(self._handle(msg))
            self._in_flight[task] = msg
            task.add_done_callback(self._on_done)

    async def _bus_away(self, exc: Exception) -> None:
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since > BUS_AWAY_LIMIT_S:
            raise RuntimeError(
                f"consumer {self.spec.durable}: fetches failed for {BUS_AWAY_LIMIT_S:.0f} s"
            ) from exc
        log.warning("fetch failed; retrying", consumer=self.spec.durable, error=repr(exc))
        await asyncio.sleep(0.5)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            # _handle catches handler errors; reaching here means acking itself failed.
            log.error(
                "message handling failed", consumer=self.spec.durable, error=repr(task.exception())
            )

    async def _handle(self, msg: Msg) -> None:
        delivery = self._delivery(msg)
        try:
            message = wire.decode(self._type, msg.data, delivery.headers)
        except wire.InvalidMessage as exc:
            await self._dead_letter(msg, delivery, exc.reason, str(exc))
            return
        if delivery.num_delivered > self.spec.max_deliver:
            await self._dead_letter(
                msg, delivery, "max_deliver", "no handler verdict within max_deliver attempts"
            )
            return
        await self._run_handler(msg, message, delivery)

    async def _run_handler(self, msg: Msg, message: M, delivery: Delivery) -> None:
        try:
            with self._handler_seconds.time():
                await self._handler(message, delivery)
        except PermanentError as exc:
            await self._dead_letter(msg, delivery, "rejected", str(exc))
            return
        except Exception as exc:
            await self._retry_or_give_up(msg, delivery, exc)
            return
        await msg.ack()
        self.num_handled += 1
        self._acked.inc()

    async def _retry_or_give_up(self, msg: Msg, delivery: Delivery, exc: Exception) -> None:
        if delivery.num_delivered >= self.spec.max_deliver:
            await self._dead_letter(msg, delivery, "max_deliver", repr(exc))
            return
        delay_s = backoff_delay_s(delivery.num_delivered, self._backoff_s)
        log.warning(
            "handler failed, will retry",
            consumer=self.spec.durable,
            seq=delivery.stream_sequence,
            attempt=delivery.num_delivered,
            retry_in_s=delay_s,
            error=repr(exc),
        )
        await msg.nak(delay=delay_s)
        HANDLED.labels(self.spec.durable, "nak").inc()

    async def _keep_alive(self) -> None:
        """Every third of ack_wait, tell the server the messages still being handled are in
        progress, so a slow handler is not redelivered (one ticker, not one task a message)."""
        while True:
            await asyncio.sleep(self.spec.ack_wait_s / 3)
            for msg in list(self._in_flight.values()):
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _dead_letter(self, msg: Msg, delivery: Delivery, reason: str, error: str) -> None:
        try:
            await publish_dead_letter(
                self._publisher, msg.data, delivery, self.spec.durable, reason, error
            )
        except Exception as exc:
            # Not stored: leave the message with the server, to be dead-lettered next time.
            log.error("dead-letter publish failed", seq=delivery.stream_sequence, error=repr(exc))
            await msg.nak(delay=backoff_delay_s(len(self._backoff_s), self._backoff_s))
            return
        await msg.ack()
        log.warning(
            "dead-lettered",
            consumer=self.spec.durable,
            seq=delivery.stream_sequence,
            reason=reason,
            error=error[:200],
        )
        HANDLED.labels(self.spec.durable, f"dead_{reason}").inc()

    def _delivery(self, msg: Msg) -> Delivery:
        meta = msg.metadata
        return Delivery(
            subject=msg.subject,
            stream=meta.stream,
            stream_sequence=meta.sequence.stream,
            num_delivered=meta.num_delivered,
            headers=dict(msg.headers or {}),
            num_pending=meta.num_pending or 0,
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop fetching; let in-flight handlers finish for `grace_s`, then nak the rest."""
        self._stopping.set()
        pending = list(self._in_flight)
        if pending:
            _, still_running = await asyncio.wait(pending, timeout=grace_s)
            for task in still_running:
                msg = self._in_flight.get(task)
                task.cancel()
                if msg is not None:
                    with contextlib.suppress(Exception):
                        await msg.nak()
        log.info("consumer stopped", consumer=self.spec.durable, handled=self.num_handled)
