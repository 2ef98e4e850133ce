"""A small HTTP server for `/healthz`, `/readyz` and `/metrics`, on the service's own loop.

Two GET endpoints need no web framework; keeping it on asyncio's stream server means no
extra thread and no second signal handler fighting the service's own.

Slow or stuck clients cannot pile up: a request's head must arrive within
`HEAD_TIMEOUT_S` of the connection (else 400 and closed), and past `MAX_CONNECTIONS` open
connections a new one is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = structlog.get_logger(__name__)

HEALTHY_STATUSES = frozenset({"ok", "idle"})
MAX_REQUEST_BYTES = 8192
HEAD_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
}


class HealthServer:
    """Serves `health()` as JSON on /healthz (200 when ok or idle, else 503), `ready()` on
    /readyz (200 or 503: whether a load balancer may send traffic; default: healthy) and
    metrics."""

    def __init__(
        self,
        health: Callable[[], dict[str, Any]],
        host: str,
        port: int,
        registry: CollectorRegistry = REGISTRY,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._health = health
        self._ready = ready
        self._host = host
        self._port = port
        self._registry = registry
        self._server: asyncio.Server | None = None
        self._num_connections = 0

    @property
    def port(self) -> int:
        """The bound port (useful when started on port 0)."""
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_connection, self._host, self._port, limit=MAX_REQUEST_BYTES
        )
        log.info("health server listening", host=self._host, port=self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self._num_connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self._num_connections += 1
        try:
            await self._answer(reader, writer)
        finally:
            self._num_connections -= 1

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                request_line = await reader.readline()
                await reader.readuntil(b"\r\n\r\n")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            # ValueError: a line over MAX_REQUEST_BYTES (readline's own limit error)
            request_line = b""
        status, content_type, body = self._respond(request_line)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    def _respond(self, request_line: bytes) -> tuple[int, str, bytes]:
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3:
            return 400, "text/plain", b"bad request\n"
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if method != "GET":
            return 405, "text/plain", b"only GET\n"
        if path == "/healthz":
            report = self._health()
            status = 200 if report.get("status") in HEALTHY_STATUSES else 503
            return status, "application/json", orjson.dumps(report)
        if path == "/readyz":
            ready = (
                self._ready() if self._ready else self._health().get("status") in HEALTHY_STATUSES
            )
            return (200 if ready else 503), "text/plain", b"ready\n" if ready else b"not ready\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return 404, "text/plain", b"not found: try /healthz, /readyz or /metrics\n"
