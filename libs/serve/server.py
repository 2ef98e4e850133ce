"""The OpenAI-compatible API on uvicorn, as a task of the rollout-worker's own event loop.

`stop` stops accepting and lets open requests finish for `graceful_s` while the service's
generation batcher still runs; what is still open then is cancelled and answered 503
(`OpenAIApi.stop_open`). Slow clients are cut off by the `limits` deadlines (HttpLimits).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from libs.api_server import ApiServer, HttpLimits

TASK_NAME = "serve-api"


class ServeServer(ApiServer):
    """Serves `app` on `host:port` (0 picks a free port) until `stop`; `on_grace_over`:
    `OpenAIApi.stop_open` of the app's API."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        graceful_s: float = 10.0,
        limits: HttpLimits | None = None,
        on_grace_over: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            app,
            host,
            port,
            graceful_s,
            task_name=TASK_NAME,
            label="OpenAI-compatible API",
            port_setting="RLPIPE_ROLLOUT_WORKER_SERVE_PORT",
            backlog=1024,
            limits=limits,
            on_grace_over=on_grace_over,
        )
