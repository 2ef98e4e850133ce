"""FastAPI apps on uvicorn inside a service's own event loop, the service owning the signals.

`uvicorn.Server.serve()` wraps its work in `capture_signals()`, which (uvicorn 0.54)
replaces the SIGINT/SIGTERM handlers with `signal.signal` for as long as it serves, then
restores them and *re-raises* the signals it caught. Inside a service whose lifecycle already
handles SIGTERM through the loop, that would steal the signal and later raise it again, so
`EmbeddedServer` makes `capture_signals` a no-op and the service stops uvicorn itself
(`should_exit`), draining open requests for `graceful_s`. Used by the feedback API and by the
rollout-worker's serve mode.

Slow clients (`HttpLimits`): uvicorn reads a request's head and body without a deadline, and
a connection that never sends a byte stays open forever, so 200 clients sending half a header
would hold 200 connections indefinitely. `ReadDeadlineProtocol` (uvicorn's h11 protocol plus
deadlines) closes a connection whose request head is not complete `header_timeout_s` after
its first byte (or after the connection opened), or whose body is not complete
`body_timeout_s` after its head; idle keep-alive connections close after `keep_alive_s`, and
past `max_connections` open connections new requests get 503 (uvicorn's limit_concurrency).
Closed connections are counted in `rlpipe_http_read_timeouts_total{api, phase}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

import h11
import structlog
import uvicorn
from fastapi import FastAPI
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)

READ_TIMEOUTS = Counter(
    "rlpipe_http_read_timeouts_total",
    "Connections closed because a request's head or body was not read in time",
    ["api", "phase"],
)

Phase = Literal["headers", "body"]


class HttpLimits(BaseModel):
    """How long a client may take to send a request, and how many connections stay open."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a client has to send a request's head (line + headers)"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time a client has to send a request's body after its head"
    )
    keep_alive_s: int = Field(
        30, ge=1, description="Idle time before a keep-alive connection is closed"
    )
    max_connections: int = Field(
        1024, ge=1, description="Open connections beyond which new requests get 503"
    )


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request's head and body."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    api: ClassVar[str] = "api"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: Phase | None = None
        self._arm("headers")  # a connection that never sends a byte is a slow head too

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Arm the deadline of what the connection waits for now, if anything."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif state is h11.IDLE:
            # Bytes of a next request's head arrived; no bytes: uvicorn's keep-alive timer.
            if self._phase is None and self.conn.trailing_data[0]:
                self._arm("headers")
        else:
            self._arm(None)

    def _arm(self, phase: Phase | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, phase)

    def _expired(self, phase: Phase) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        READ_TIMEOUTS.labels(self.api, phase).inc()
        self.transport.close()


def read_deadline_protocol(limits: HttpLimits, api: str) -> type[ReadDeadlineProtocol]:
    """`ReadDeadlineProtocol` with `limits`' deadlines, for uvicorn's `http` setting."""
    fields: dict[str, Any] = {
        "header_timeout_s": limits.header_timeout_s,
        "body_timeout_s": limits.body_timeout_s,
        "api": api,
    }
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), fields)


class ApiServer:
    """Serves `app` on `host:port` (0 picks a free port) as task `task_name` of this loop.

    `label` names the API in logs and errors; `port_setting` is the variable that sets the
    port, named in the error when the port is taken. `on_grace_over` is called when requests
    are still open `graceful_s` after `stop`, so the app can answer them itself before
    uvicorn cancels what is left (a second later).
    """

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        graceful_s: float = 10.0,
        *,
        task_name: str,
        label: str,
        port_setting: str,
        backlog: int = 2048,
        limits: HttpLimits | None = None,
        on_grace_over: Callable[[], None] | None = None,
    ) -> None:
        limits = limits or HttpLimits()
        self.graceful_s = graceful_s
        self.on_grace_over = on_grace_over
        # uvicorn cancels what is open after its own graceful time: after the app's hook.
        uvicorn_grace_s = max(1, int(graceful_s)) + (1 if on_grace_over else 0)
        config = uvicorn.Config(
            app,
            http=read_deadline_protocol(limits, task_name),
            log_config=None,  # logging is the service's (structlog), configured in main
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=uvicorn_grace_s,
            timeout_keep_alive=limits.keep_alive_s,
            limit_concurrency=limits.max_connections,
        )
        self._server = EmbeddedServer(config)
        self.task_name = task_name
        self.label = label
        self._socket = _bind(host, port, backlog, f"{label} cannot listen", port_setting)
        # Read once: uvicorn closes the socket when it stops, and /healthz still says the port.
        self.port: int = self._socket.getsockname()[1]
        self.task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start serving; returns once the server accepts connections."""
        serving = self._server.serve(sockets=[self._socket])
        self.task = asyncio.create_task(serving, name=self.task_name)
        async with asyncio.timeout(timeout_s):
            while not self._server.started:
                if self.task.done():
                    self.task.result()  # raise why it stopped
                    raise RuntimeError(f"the {self.label} stopped while starting")
                await asyncio.sleep(0.01)
        log.info(f"{self.label} listening", port=self.port)

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the graceful timeout), close."""
        self._server.should_exit = True
        if self.task is not None:
            if self.on_grace_over is not None:
                await asyncio.wait({self.task}, timeout=self.graceful_s)
                if not self.task.done():
                    self.on_grace_over()
            await self.task
        self._socket.close()


def _bind(host: str, port: int, backlog: int, what: str, port_setting: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and with Nagle's algorithm every small response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"{what} on {host}:{port} ({exc}); set {port_setting} to a free port"
        ) from exc
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
