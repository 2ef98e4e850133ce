"""Admission control of serve mode: how many requests generate, wait, and what one key holds.

A request is admitted before it generates and holds its place until it is answered:

    admission = Admission(AdmissionLimits(max_running=4, max_queued=16, ...))
    async with admission.admit("acme-web", cost_tokens=n * (len(prompt) + max_tokens)):
        result = await served.serve(request)

It is refused at once, never queued without bound:
- 429 (`Retry-After: retry_after_s`) when the key already has `max_requests_per_key`
  requests open or its open requests' tokens plus this one's pass `max_tokens_per_key`, or
  when `max_running` generate and `max_queued` wait already;
- 400 when the request alone costs more tokens than a key may hold (it could never run).
Otherwise it runs at once, or waits its turn (first come, first served) for one of the
`max_running` slots. A caller cancelled while waiting (its client went away) leaves the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import Counter as MetricCounter
from prometheus_client import Gauge

from libs.serve.protocol import ApiError, invalid

REFUSED = MetricCounter(
    "rlpipe_serve_requests_refused_total",
    "Serve-mode requests refused by admission control (429), by reason",
    ["reason"],
)
RUNNING = Gauge("rlpipe_serve_requests_running", "Serve-mode requests generating now")
QUEUED = Gauge("rlpipe_serve_requests_queued", "Serve-mode requests waiting to generate")


@dataclass(frozen=True)
class AdmissionLimits:
    """The bounds (ServeConfig's max_running_requests, ... busy_retry_after_s)."""

    max_running: int = 4
    max_queued: int = 16
    max_requests_per_key: int = 8
    max_tokens_per_key: int = 262_144
    retry_after_s: int = 1


class Admission:
    """Counts open requests per key and hands out the generating slots; see the module doc."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.num_running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def admit(self, key: str, cost_tokens: int) -> AsyncIterator[None]:
        """Hold a generating slot for `key`'s request of `cost_tokens` while inside."""
        self._check(key, cost_tokens)
        self._requests[key] += 1
        self._tokens[key] += cost_tokens
        try:
            await self._take_slot()
            try:
                yield
            finally:
                self._give_slot()
        finally:
            self._requests[key] -= 1
            self._tokens[key] -= cost_tokens
            if not self._requests[key]:
                del self._requests[key], self._tokens[key]

    def check_open(self, key: str) -> None:
        """429 when `key` or the queue has no room whatever the request asks (checked before
        its body is decoded, so a flood's refusals cost little)."""
        limits = self.limits
        if self._requests[key] >= limits.max_requests_per_key:
            self._refuse("key_requests", f"{limits.max_requests_per_key} requests of this key")
        busy = self.num_running >= limits.max_running or self._waiting
        if busy and len(self._waiting) >= limits.max_queued:
            self._refuse("queue_full", f"{limits.max_running} requests and a full queue")

    def _check(self, key: str, cost_tokens: int) -> None:
        limits = self.limits
        if cost_tokens > limits.max_tokens_per_key:
            raise invalid(
                f"this request holds n * (prompt + max_tokens) = {cost_tokens} tokens, over the "
                f"{limits.max_tokens_per_key} one key may hold (serve.max_tokens_per_key): "
                "lower n or max_tokens",
                "max_tokens",
            )
        self.check_open(key)
        if self._tokens[key] + cost_tokens > limits.max_tokens_per_key:
            self._refuse("key_tokens", f"{limits.max_tokens_per_key} tokens of this key")

    def _refuse(self, reason: str, what: str) -> None:
        REFUSED.labels(reason).inc()
        raise ApiError(
            429,
            f"serve mode is at its limit ({what} are open); retry after "
            f"{self.limits.retry_after_s} s",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            retry_after_s=self.limits.retry_after_s,
        )

    async def _take_slot(self) -> None:
        if self.num_running < self.limits.max_running and not self._waiting:
            self._set_running(self.num_running + 1)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        QUEUED.set(len(self._waiting))
        try:
            await turn  # `_give_slot` passes a slot on with set_result
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._give_slot()  # handed a slot as it was cancelled: pass it on
            elif turn in self._waiting:  # `_give_slot` may have dropped it already
                self._waiting.remove(turn)
                QUEUED.set(len(self._waiting))
            raise

    def _give_slot(self) -> None:
        """Hand the slot to the longest waiter, or free it."""
        while self._waiting:
            turn = self._waiting.popleft()
            QUEUED.set(len(self._waiting))
            if not turn.done():
                turn.set_result(None)
                return
        self._set_running(self.num_running - 1)

    def _set_running(self, count: int) -> None:
        self.num_running = count
        RUNNING.set(count)
