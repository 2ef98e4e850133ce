"""Benchmark the feedback API: sustained events/s with durable acknowledgement, and latency.

Starts its own nats-server (JetStream file storage, temp folder) and the real
feedback-ingester process (role=api, its own CPU), then drives it over loopback HTTP with
`--clients` concurrent keep-alive connections (a minimal asyncio HTTP/1.1 client) for
`--duration-s` per case:
- single: POST /v1/feedback, one event per request;
- batch: POST /v1/feedback:batch, `--batch` events per request.
Every 202 means the event is stored in the feedback stream (the PubAck came). Latency is
per request, from send to answer. Beside it, in the same run: raw nats-py
`js.publish_async` of the same encoded events (256 in flight), the bus's own ceiling.
On a 2-core machine the load generator, the ingester and nats-server share the cores.

    .venv/bin/python bench/feedback_bench.py [--duration-s 10] [--clients 64] [--batch 50]

Writes bench/results/<machine>/feedback.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import msgspec
from result_file import result_file, result_json

from libs.bus import wire
from libs.bus.connection import connect_bus
from libs.bus.provision import provision
from libs.feedback.auth import ApiKeyEntry, hash_key
from libs.nats_server import NatsServer, free_port
from proto import subjects
from proto.messages import FeedbackEvent

RESULTS = result_file("feedback")
KEY = "rlfb_bench-key-0123456789"


def event(i: int, run: str) -> dict[str, Any]:
    return {
        "event_id": f"{run}-{i}",
        "generation_id": f"gen-{i % 1000}",
        "product": "acme",
        "signal": "accepted",
        "occurred_at": time.time(),
        "user_hash": "u-5f2c9a",
        "session_hash": "s-91aa07",
        "experiment_arm": "control",
    }


async def raw_publish_rate(url: str, count: int) -> dict[str, float]:
    bus = await connect_bus(url, name="bench-raw")
    events = [msgspec.convert(event(i, "raw"), FeedbackEvent) for i in range(count)]
    payloads = [(wire.encode(e), wire.headers_for(e, e.event_id)) for e in events]
    window = asyncio.Semaphore(256)
    futures = []
    started = time.perf_counter()
    for payload, headers in payloads:
        await window.acquire()
        future = await bus.js.publish_async(subjects.FEEDBACK_EVENTS, payload, headers=headers)
        future.add_done_callback(lambda _: window.release())
        futures.append(future)
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - started
    await bus.close()
    return {"count": count, "seconds": elapsed, "msgs_per_s": count / elapsed}


class Connection:
    """One keep-alive HTTP/1.1 connection with a minimal client: far cheaper per request
    than httpx, whose pool slows down with many connections, so the load generator leaves
    the CPU to the server it measures."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def drive(port: int, clients: int, duration_s: float, batch: int, run: str) -> dict[str, Any]:
    """`clients` connections post until `duration_s` has passed; returns rates and latencies."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    counter = iter(range(10**9))
    connections = [await Connection.open("127.0.0.1", port) for _ in range(clients)]
    deadline = time.perf_counter() + duration_s

    async def worker(connection: Connection) -> None:
        while time.perf_counter() < deadline:
            if batch == 1:
                path, body = "/v1/feedback", event(next(counter), run)
            else:
                path = "/v1/feedback:batch"
                body = {"events": [event(next(counter), run) for _ in range(batch)]}
            content = msgspec.json.encode(body)
            sent = time.perf_counter()
            status, _ = await connection.post(path, content)
            latencies.append(time.perf_counter() - sent)
            statuses[status] = statuses.get(status, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    accepted = statuses.get(202, 0)
    latencies.sort()
    return {
        "clients": clients,
        "events_per_request": batch,
        "seconds": elapsed,
        "requests": len(latencies),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "requests_per_s": len(latencies) / elapsed,
        "events_per_s": accepted * batch / elapsed,
        "latency_ms": {
            "p50": 1000 * latencies[len(latencies) // 2],
            "p99": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "max": 1000 * latencies[-1],
            "mean": 1000 * statistics.fmean(latencies),
        },
    }


def start_ingester(nats_url: str, api_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    key = ApiKeyEntry(name="bench", sha256=hash_key(KEY), products=["acme"])
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_url,
        "RLPIPE_FEEDBACK_INGESTER_ROLE": "api",
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": str(free_port()),
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": str(api_port),
        "RLPIPE_FEEDBACK_INGESTER_API_KEYS": json.dumps([key.model_dump()]),
        "RLPIPE_FEEDBACK_INGESTER_RATE_PER_S": "1000000",
        "RLPIPE_FEEDBACK_INGESTER_RATE_BURST_EVENTS": "1000000",
        "RLPIPE_LOG_LEVEL": "warning",
    }
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.feedback_ingester"], env=env, stdout=log, stderr=log
        )


async def wait_healthy(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("the feedback ingester did not come up")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats")
        server.start()
        ingester = None
        try:
            bus = await connect_bus(server.url, name="bench-provision")
            await provision(bus.js)
            await bus.close()
            raw = await raw_publish_rate(server.url, args.raw_count)
            api_port = free_port()
            ingester = start_ingester(server.url, api_port, Path(tmp) / "ingester.log")
            url = f"http://127.0.0.1:{api_port}"
            await wait_healthy(url)
            await drive(api_port, args.clients, 2.0, 1, "warmup")
            single = await drive(api_port, args.clients, args.duration_s, 1, "single")
            batch = await drive(api_port, args.batch_clients, args.duration_s, args.batch, "batch")
        finally:
            if ingester is not None:
                ingester.terminate()
                ingester.wait(timeout=30)
            server.stop()
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "nats_py": version("nats-py"),
            "uvicorn": version("uvicorn"),
            "fastapi": version("fastapi"),
        },
        "settings": {
            "duration_s": args.duration_s,
            "clients": args.clients,
            "batch_clients": args.batch_clients,
            "batch": args.batch,
            "http_parser": "httptools" if _has("httptools") else "h11",
            "notes": "load generator, ingester (uvicorn) and nats-server share "
            "the machine's cores; 202 = stored in JetStream (file storage); latency per request",
        },
        "raw_publish_async": raw,
        "api_single": single,
        "api_batch": batch,
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--batch-clients", type=int, default=4)
    parser.add_argument("--raw-count", type=int, default=20000)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(result_json(result))
    raw, single, batch = result["raw_publish_async"], result["api_single"], result["api_batch"]
    print(f"raw publish_async: {raw['msgs_per_s']:.0f} msg/s")
    for name, case in (("single", single), (f"batch of {args.batch}", batch)):
        lat = case["latency_ms"]
        print(
            f"API {name}: {case['events_per_s']:.0f} events/s, {case['requests_per_s']:.0f} req/s,"
            f" p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, statuses {case['statuses']}"
        )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
