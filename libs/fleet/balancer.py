"""A client-side load balancer over serve replicas that honours their readiness: what a
product's load balancer (a Kubernetes Service, an ingress with health checks) does in front
of a lending fleet, for the tests and the day-of-traffic benchmark.

    balancer = ReadyBalancer([Backend(serve_url, ready_url), ...], http)
    probing = asyncio.create_task(balancer.probe_forever(0.1))
    answer = await balancer.post("/v1/completions", {"prompt": "1+1=", "max_tokens": 4})
    answer.status, answer.latency_s, answer.replica, answer.attempts

Each backend's `/readyz` is polled every `probe_s`: a 200 makes it ready, a 503 not ready,
and `FAILURE_THRESHOLD` probes in a row without an answer (a timeout, no connection) too,
as a Kubernetes readinessProbe's failureThreshold does. A request goes to the ready backend
with the fewest requests open (ties: in turn), waiting up to `wait_s` for one. A replica
that turns unready keeps answering for its `unready_grace_s` (libs/fleet/lending.py),
longer than a probe, so requests stop going there before it refuses any. Should one still
meet a refusal that did no work (503, or no connection), it is retried on another ready
backend, as an ingress retries a 503, at most `attempts` times in all; every retry is
counted. Any other answer is final.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRYABLE = frozenset({503})
NOT_SENT = 0  # no connection: the request did no work anywhere
FAILED = -1  # the connection broke after the request was sent


PROBE_TIMEOUT_S = 5.0
FAILURE_THRESHOLD = 3


@dataclass
class Backend:
    serve_url: str
    ready_url: str
    ready: bool = False
    open_requests: int = 0
    probe_failures: int = 0  # in a row


@dataclass(frozen=True)
class Answer:
    status: int  # NOT_SENT: no backend took it; FAILED: the connection broke
    latency_s: float
    replica: str
    attempts: int
    body: dict[str, Any] = field(default_factory=dict)


class ReadyBalancer:
    """Sends each request to a ready backend; retries a refusal elsewhere."""

    def __init__(
        self,
        backends: list[Backend],
        http: httpx.AsyncClient,
        attempts: int = 4,
        wait_s: float = 60.0,
    ) -> None:
        self.backends = backends
        self.http = http
        self.attempts = attempts
        self.wait_s = wait_s
        self.num_retries = 0
        self._turn = itertools.count()

    async def probe_forever(self, probe_s: float) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(probe_s)

    async def probe(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in self.backends))

    async def _probe(self, backend: Backend) -> None:
        try:
            status = (await self.http.get(backend.ready_url, timeout=PROBE_TIMEOUT_S)).status_code
        except httpx.HTTPError:
            backend.probe_failures += 1
            backend.ready = backend.ready and backend.probe_failures < FAILURE_THRESHOLD
            return
        backend.probe_failures = 0
        backend.ready = status == 200

    async def post(self, path: str, body: dict[str, Any]) -> Answer:
        started = time.monotonic()
        tried: set[str] = set()
        for attempt in range(1, self.attempts + 1):
            backend = await self._pick(tried)
            if backend is None:
                break
            tried.add(backend.serve_url)
            status, reply = await self._send(backend, path, body)
            if status not in RETRYABLE and status != NOT_SENT:
                return Answer(status, time.monotonic() - started, backend.serve_url, attempt, reply)
            backend.ready = False  # until its next probe says otherwise
            self.num_retries += 1
        return Answer(NOT_SENT, time.monotonic() - started, "", len(tried))

    async def _pick(self, tried: set[str]) -> Backend | None:
        """The least busy ready backend not tried yet (waits up to `wait_s` for one)."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            ready = [b for b in self.backends if b.ready and b.serve_url not in tried]
            if ready:
                turn = next(self._turn) % len(ready)
                return min(ready[turn:] + ready[:turn], key=lambda b: b.open_requests)
            await asyncio.sleep(0.02)
        return None

    async def _send(
        self, backend: Backend, path: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        backend.open_requests += 1
        try:
            response = await self.http.post(backend.serve_url + path, json=body)
        except httpx.ConnectError:  # nothing was sent: another backend may take it
            return 0, {}
        except httpx.HTTPError:  # sent, and lost on the way: a failed request
            return FAILED, {}
        finally:
            backend.open_requests -= 1
        return response.status_code, response.json() if response.status_code == 200 else {}
