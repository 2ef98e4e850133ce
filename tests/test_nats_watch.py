"""The launcher's NATS supervision (apps.launcher.nats_watch): a killed nats-server comes back
on its data folder with its streams, a client rides through; one that cannot come back ends
the watch with one line naming the log."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

from apps.launcher.nats_watch import NatsWatch
from apps.launcher.supervisor import Backoff
from libs.bus.connection import connect_bus, ride_through
from libs.nats_server import NatsServer
from tests.conftest import wait_for


async def test_a_killed_nats_server_is_restarted_with_its_streams(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "nats")
    server.start()
    events: list[str] = []
    restarted: list[int | None] = []
    watch = NatsWatch(
        server,
        on_event=lambda event, **_: events.append(event),
        on_restart=lambda: restarted.append(server.pid),
        on_give_up=lambda why: events.append(why),
    )
    task = asyncio.create_task(watch.run())
    bus = await connect_bus(server.url, name="rider")
    try:
        await bus.js.add_stream(name="KEEP", subjects=["keep.>"])
        await bus.js.publish("keep.a", b"1")
        old_pid = server.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        await wait_for(lambda: bool(restarted), timeout_s=30, what="the restart")
        assert restarted[0] != old_pid and "nats-server restarted" in events
        # The same client, reconnected by nats-py, finds the stream and its message.
        info = await ride_through(lambda: bus.js.stream_info("KEEP"), "stream info")
        assert info.state.messages == 1
    finally:
        task.cancel()
        await bus.close()
        server.stop()


async def test_a_server_that_cannot_come_back_ends_the_watch_with_a_reason(
    tmp_path: Path,
) -> None:
    server = NatsServer(store_dir=tmp_path / "nats")
    server.start()
    reasons: list[str] = []
    watch = NatsWatch(
        server,
        on_event=lambda *_, **__: None,
        on_restart=lambda: None,
        on_give_up=reasons.append,
        backoff=Backoff(initial_s=0.05, max_s=0.1),
        max_attempts=2,
    )
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    await asyncio.to_thread(server.process.wait)  # type: ignore[union-attr]
    with socket.socket() as squatter:  # its port taken: every restart fails
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((server.host, server.port))
        squatter.listen()
        await asyncio.wait_for(watch.run(), timeout=60)
    assert len(reasons) == 1 and "could not be kept running" in reasons[0]
    assert "nats-server.log" in reasons[0]
