"""The OpenAI-compatible API on uvicorn, as a task of the rollout-worker's own event loop.

Signals stay the service's (`EmbeddedServer` from libs.feedback.server: uvicorn must not
take SIGTERM); `stop` stops accepting and lets open requests finish for `graceful_s`
while the service's generation batcher still runs.
"""

from __future__ import annotations

import asyncio
import socket

import structlog
import uvicorn
from fastapi import FastAPI

from libs.feedback.server import EmbeddedServer

log = structlog.get_logger(__name__)

TASK_NAME = "serve-api"


class ServeServer:
    """Serves `app` on `host:port` (0 picks a free port) until `stop`."""

    def __init__(self, app: FastAPI, host: str, port: int, graceful_s: float = 10.0) -> None:
        config = uvicorn.Config(
            app,
            log_config=None,  # logging is the service's (structlog), configured in main
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=max(1, int(graceful_s)),
            timeout_keep_alive=30,
        )
        self._server = EmbeddedServer(config)
        self._socket = _bind(host, port)
        self.task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        port: int = self._socket.getsockname()[1]
        return port

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start serving; returns once the server accepts connections."""
        serving = self._server.serve(sockets=[self._socket])
        self.task = asyncio.create_task(serving, name=TASK_NAME)
        async with asyncio.timeout(timeout_s):
            while not self._server.started:
                if self.task.done():
                    self.task.result()  # raise why it stopped
                    raise RuntimeError("the serve-mode API stopped while starting")
                await asyncio.sleep(0.01)
        log.info("OpenAI-compatible API listening", port=self.port)

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the graceful timeout), close."""
        self._server.should_exit = True
        if self.task is not None:
            await self.task
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP so asyncio sets TCP_NODELAY (no ~40 ms delayed-ACK wait per response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"serve mode cannot listen on {host}:{port} ({exc}); set "
            "RLPIPE_ROLLOUT_WORKER_SERVE_PORT to a free port"
        ) from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock
