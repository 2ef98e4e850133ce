"""The OpenAI-compatible API on uvicorn, as a task of the rollout-worker's own event loop.

`stop` stops accepting and lets open requests finish for `graceful_s` while the service's
generation batcher still runs (libs.api_server).
"""

from __future__ import annotations

from fastapi import FastAPI

from libs.api_server import ApiServer

TASK_NAME = "serve-api"


class ServeServer(ApiServer):
    """Serves `app` on `host:port` (0 picks a free port) until `stop`."""

    def __init__(self, app: FastAPI, host: str, port: int, graceful_s: float = 10.0) -> None:
        super().__init__(
            app,
            host,
            port,
            graceful_s,
            task_name=TASK_NAME,
            label="OpenAI-compatible API",
            port_setting="RLPIPE_ROLLOUT_WORKER_SERVE_PORT",
            backlog=1024,
        )
