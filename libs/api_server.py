"""FastAPI apps on uvicorn inside a service's own event loop, the service owning the signals.

`uvicorn.Server.serve()` wraps its work in `capture_signals()`, which (uvicorn 0.54)
replaces the SIGINT/SIGTERM handlers with `signal.signal` for as long as it serves, then
restores them and *re-raises* the signals it caught. Inside a service whose lifecycle already
handles SIGTERM through the loop, that would steal the signal and later raise it again, so
`EmbeddedServer` makes `capture_signals` a no-op and the service stops uvicorn itself
(`should_exit`), draining open requests for `graceful_s`. Used by the feedback API and by the
rollout-worker's serve mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import structlog
import uvicorn
from fastapi import FastAPI

log = structlog.get_logger(__name__)


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    """Serves `app` on `host:port` (0 picks a free port) as task `task_name` of this loop.

    `label` names the API in logs and errors; `port_setting` is the variable that sets the
    port, named in the error when the port is taken.
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
    ) -> None:
        config = uvicorn.Config(
            app,
            log_config=None,  # logging is the service's (structlog), configured in main
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=max(1, int(graceful_s)),
            # Keep-alive connections of a busy client stay open between requests.
            timeout_keep_alive=30,
        )
        self._server = EmbeddedServer(config)
        self.task_name = task_name
        self.label = label
        self._socket = _bind(host, port, backlog, f"{label} cannot listen", port_setting)
        self.task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        port: int = self._socket.getsockname()[1]
        return port

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
