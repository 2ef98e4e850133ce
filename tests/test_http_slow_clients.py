"""Slow clients cannot hold an HTTP surface: the APIs on uvicorn (serve mode, the feedback
API: libs.api_server) and every service's health server close a connection whose request
head or body does not arrive in time, and serve everyone else meanwhile. Real sockets
against real servers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
from fastapi import FastAPI

from libs.api_server import ApiServer, HttpLimits
from libs.health_server import MAX_CONNECTIONS, HealthServer


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass
    return True


async def test_slow_clients_are_cut_off_and_others_are_served_meanwhile() -> None:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=1024)
    server = ApiServer(
        app, "127.0.0.1", 0, task_name="slow-test", label="test API", port_setting="X",
        limits=limits,
    )  # fmt: skip
    await server.start()
    try:
        connections = []
        for index in range(60):  # 20 silent, 20 half a head, 20 half a body
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            if index % 3 == 1:
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
            elif index % 3 == 2:
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            connections.append((reader, writer))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            assert (await http.post("/echo", json={"a": 1})).json() == {"a": 1}
        async with asyncio.timeout(60):  # against a hang only: the server closes them
            assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in connections)))
        for _, writer in connections:
            writer.close()
    finally:
        await server.stop()


async def test_the_health_server_cuts_off_slow_and_surplus_connections() -> None:
    server = HealthServer(lambda: {"status": "ok"}, "127.0.0.1", 0)
    await server.start()
    try:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(70)]
        for _, writer in held[:10]:
            writer.write(b"GET /healthz HTTP/1.1\r\nHo")  # half a head
        async with asyncio.timeout(60):
            answers = [await reader.read() for reader, _ in held]
        assert sum(1 for answer in answers if answer == b"") >= 70 - MAX_CONNECTIONS
        assert all(a == b"" or a.startswith(b"HTTP/1.1 400") for a in answers)
        for _, writer in held:
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")  # a line over the limit
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
    finally:
        await server.stop()


async def test_an_api_server_still_names_its_port_once_stopped() -> None:
    """uvicorn closes the listening socket when it stops; the worker's /healthz, which says
    the serve port, must keep answering through the drain."""
    server = ApiServer(FastAPI(), "127.0.0.1", 0, task_name="t", label="test API", port_setting="X")
    await server.start()
    port = server.port
    await server.stop()
    assert server.port == port
