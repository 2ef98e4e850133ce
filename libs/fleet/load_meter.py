"""A serve replica's product traffic, as its heartbeat reports it to the capacity controller.

    meter = LoadMeter(window_s=20.0)
    app.add_middleware(LoadMiddleware, meter=meter)     # every /v1/ request is timed
    meter.load(running=2, queued=0)                     # a proto.fleet.ReplicaLoad

The middleware is plain ASGI around the serve app: it notes when each request to an API
route (`/v1/...`, not `/v1/models`) arrives and when its answer starts, with its status.
`load` reports, over the last `window_s` seconds, the arrival rate (answered or refused:
what the replica was asked for), the p50 and p99 latency of the answered ones, and the 5xx
answers.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proto.fleet import ReplicaLoad

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
METERED_PREFIX = "/v1/"
NOT_METERED = frozenset({"/v1/models"})


class LoadMeter:
    """Arrivals and answers of product requests over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._arrivals: deque[float] = deque()
        self._answers: deque[tuple[float, float, int]] = deque()  # (at, latency_s, status)

    def arrived(self) -> float:
        now = time.monotonic()
        self._arrivals.append(now)
        return now

    def answered(self, arrived_at: float, status: int) -> None:
        now = time.monotonic()
        self._answers.append((now, now - arrived_at, status))

    def load(self, running: int = 0, queued: int = 0) -> ReplicaLoad:
        """The window's rate and latency, with the open requests counted by the caller."""
        self._forget_before(time.monotonic() - self.window_s)
        latencies = sorted(latency for _, latency, status in self._answers if status < 500)
        return ReplicaLoad(
            window_s=self.window_s,
            requests_per_s=len(self._arrivals) / self.window_s,
            running=running,
            queued=queued,
            p50_latency_s=_quantile(latencies, 0.5),
            p99_latency_s=_quantile(latencies, 0.99),
            errors=sum(1 for _, _, status in self._answers if status >= 500),
        )

    def _forget_before(self, cutoff: float) -> None:
        while self._arrivals and self._arrivals[0] < cutoff:
            self._arrivals.popleft()
        while self._answers and self._answers[0][0] < cutoff:
            self._answers.popleft()


class LoadMiddleware:
    """ASGI middleware that reports the API's requests to a LoadMeter."""

    def __init__(self, app: ASGIApp, meter: LoadMeter) -> None:
        self.app = app
        self.meter = meter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        metered = scope["type"] == "http" and path.startswith(METERED_PREFIX)
        if not metered or path in NOT_METERED:
            await self.app(scope, receive, send)
            return
        arrived_at = self.meter.arrived()

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.meter.answered(arrived_at, int(message["status"]))
            await send(message)

        await self.app(scope, receive, noting_send)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return round(sorted_values[rank - 1], 6)
