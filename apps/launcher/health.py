"""Polls each service's `GET /healthz` about once a second and keeps the latest answer.

A service answers 200 when healthy and 503 when not, both with a JSON body such as
`{"service": "trainer", "status": "ok", "detail": "...", "step": 12, "policy_version": 3}`.
An answer naming another service is no answer: another process holds the port, and its
"ok" must not pass for a service that cannot bind it (and may be crash-looping).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HealthRecord:
    """The latest health answer of one service; `ever_healthy` survives restarts."""

    url: str
    service: str = ""  # the service expected to answer ("": any)
    status_code: int | None = None
    body: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    ever_healthy: bool = False
    pid: int | None = None

    @property
    def status(self) -> str:
        """The service's own status word, or why there is none."""
        if self.error:
            return "unreachable"
        return str(self.body.get("status", "unknown")) if self.status_code else "unknown"

    @property
    def detail(self) -> str:
        return self.error or str(self.body.get("detail", ""))


def fetch_health(url: str, timeout_s: float = 1.0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of one GET; a 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, parse_body(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, parse_body(exc.read())


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"detail": raw[:200].decode(errors="replace")}
    return body if isinstance(body, dict) else {"detail": str(body)[:200]}


class HealthMonitor:
    """Keeps one `HealthRecord` per service, polled while the service's process is alive."""

    def __init__(
        self,
        urls: Mapping[str, str],
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        services: Mapping[str, str] | None = None,
    ):
        """`urls` by name (a service, or an instance of one); `services`: the service each
        name's answer must come from (default: any)."""
        services = services or {}
        self.records = {
            name: HealthRecord(url, services.get(name, "")) for name, url in urls.items()
        }
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self, live_pids: Callable[[], Mapping[str, int | None]]) -> None:
        """Poll forever (cancel to stop); `live_pids` maps a service to its running pid or None."""
        while True:
            await self.poll_once(live_pids())
            await asyncio.sleep(self.interval_s)

    async def poll_once(self, live_pids: Mapping[str, int | None]) -> None:
        names = [name for name in self.records if live_pids.get(name) is not None]
        await asyncio.gather(*(self._poll(name, live_pids[name]) for name in names))

    async def _poll(self, name: str, pid: int | None) -> None:
        record = self.records[name]
        if record.pid != pid:
            # A restarted service starts over: its old answer says nothing about it.
            record.pid, record.status_code, record.body, record.error = pid, None, {}, ""
        try:
            code, body = await asyncio.to_thread(fetch_health, record.url, self.timeout_s)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            record.error = f"no answer from {record.url}: {_reason(exc)}"
            return
        answered = str(body.get("service", ""))
        if record.service and _package(answered) != _package(record.service):
            record.status_code, record.body = None, {}
            record.error = (
                f"{record.url} answers as {answered or 'no service'!r}, not {record.service}: "
                "another process holds the port"
            )
            return
        record.status_code, record.body, record.error = code, body, ""
        record.ever_healthy = record.ever_healthy or code == 200


def _package(service: str) -> str:
    """A service's name as its package spells it ("env-gateway" and "env_gateway" alike)."""
    return service.replace("-", "_")


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or exc)
