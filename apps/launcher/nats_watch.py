"""Supervise the launcher's own nats-server: restart it on its data folder when it dies.

    watch = NatsWatch(server, on_event=log.info, on_restart=write_pids, on_give_up=fail)
    task = asyncio.create_task(watch.run())      # until cancelled (before NATS is stopped)

The server restarts on the same port and JetStream folder, so streams, consumers and the
KV bucket come back as they were and the services (nats-py reconnects on its own) ride
through. A cluster (`rlpipe demo --nats-cluster 3`) gets one watch per node: while a node is
down the other two keep every replicated stream going, and the restarted node catches up.
After `max_attempts` failed starts in a row, or `max_restarts` restarts within `window_s`,
it gives up: `on_give_up` gets one line saying why and where the log is, and the
launcher stops the run with a non-zero exit, never a silent hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from apps.launcher.supervisor import Backoff, describe_exit
from libs.nats_server import NatsServer

POLL_S = 0.25


class NatsWatch:
    """Restarts `server` whenever its process exits, until cancelled or out of attempts."""

    def __init__(
        self,
        server: NatsServer,
        *,
        on_event: Callable[..., None],
        on_restart: Callable[[], None],
        on_give_up: Callable[[str], Any],
        backoff: Backoff | None = None,
        max_attempts: int = 5,
        max_restarts: int = 5,
        window_s: float = 300.0,
    ) -> None:
        self.server = server
        self._on_event = on_event
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._backoff = backoff or Backoff(initial_s=0.25, max_s=5.0)
        self._max_attempts = max_attempts
        self._max_restarts = max_restarts
        self._window_s = window_s
        self.restarts: list[float] = []  # monotonic times of successful restarts

    async def run(self) -> None:
        """Watch; returns only after giving up (the caller cancels it to stop watching)."""
        while True:
            code = await self._wait_exit()
            self._on_event(
                "nats-server exited",
                node=self.server.server_name,
                reason=describe_exit(code),
                restarting=True,
            )
            problem = await self._restart()
            if problem is not None:
                self._on_give_up(problem)
                return

    async def _wait_exit(self) -> int:
        process = self.server.process
        assert process is not None, "start the server before watching it"
        while (code := process.poll()) is None:
            await asyncio.sleep(POLL_S)
        return code

    async def _restart(self) -> str | None:
        """Start the server again; why it could not be, or None."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < self._window_s]
        if len(self.restarts) >= self._max_restarts:
            return self._why(f"it died {len(self.restarts) + 1} times in {self._window_s:.0f} s")
        error = ""
        for attempt in range(1, self._max_attempts + 1):
            await asyncio.sleep(self._backoff.delay_s(attempt))
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.server.start)
            except (OSError, RuntimeError, TimeoutError) as exc:
                error = str(exc)
                self._on_event("nats-server restart failed", attempt=attempt, error=error)
                continue
            self.restarts.append(time.monotonic())
            self._on_event(
                "nats-server restarted",
                pid=self.server.pid,
                url=self.server.url,
                start_s=round(time.monotonic() - started, 2),
            )
            self._on_restart()
            return None
        return self._why(f"{self._max_attempts} restarts failed, last: {error}")

    def _why(self, detail: str) -> str:
        log = self.server.log_path or self.server.store_dir / "nats-server.log"
        return f"nats-server died and could not be kept running ({detail}); see {log}"
