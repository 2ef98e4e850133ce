"""Benchmark the feedback path: the API's sustained events/s with durable acknowledgement and
latency, and the join's events/s with one generation id flooded.

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

The join (per case, each on a fresh nats-server): the generations are stored and a first
feedback-ingester process (role=join) indexes them (served before they are rated) and
stops; the feedback is stored meanwhile; a second one drains it, as after a restart, and is
measured: events/s from its first delivery until both consumers are drained, and on the
ordinary ids from the samples' `joined_at` (the joiner's clock), first to last. Ordinary
events are `--join-events` events on `--join-events / 2` ids (2 each); the flood is
`--hot-events` events on one id, shuffled in among them. Cases: `ordinary` (no flood),
`hot_indexed` (the flooded id's generation indexed: its events meet the cap as they come)
and `hot_waiting` (its generation comes after every event was handled: all of them wait,
then one flush). Every event carries a key name, so the key's sample budget is in the path.

    .venv/bin/python bench/feedback_bench.py [--duration-s 10] [--clients 64] [--batch 50]
        [--join-events 10000] [--hot-events 10000] [--skip-api]

Writes bench/results/<machine>/feedback.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import msgspec
from result_file import result_file, result_json

from libs.bus import wire
from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import provision
from libs.bus.stream_scan import scan_stream
from libs.feedback.auth import ApiKeyEntry, hash_key
from libs.feedback.join import JoinConfig
from libs.nats_server import NatsServer, free_port
from proto import streams, subjects
from proto.messages import (
    FeedbackEvent,
    Message,
    OnlineSample,
    SamplingSettings,
    ServedGeneration,
)
from proto.streams import JOINER_FEEDBACK, JOINER_GENERATIONS, ConsumerSpec

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


# --- the join ------------------------------------------------------------------------------

HOT_ID = "gen-hot"


def join_event(event_id: str, generation_id: str) -> FeedbackEvent:
    now = time.time()
    return FeedbackEvent(
        event_id=event_id,
        generation_id=generation_id,
        product="acme",
        signal="accepted",
        occurred_at=now,
        received_at=now,
        key_name="bench",
        key_id="0123456789ab",
    )


def served(generation_id: str) -> ServedGeneration:
    return ServedGeneration(
        generation_id=generation_id,
        policy_version=1,
        prompt_token_ids=list(range(64)),
        completion_token_ids=list(range(32)),
        logprobs=[-0.5] * 32,
        sampling=SamplingSettings(),
        created_at=time.time(),
    )


async def publish_all(bus: Bus, subject: str, messages: list[tuple[Message, str]]) -> None:
    """Store messages (with their msg ids) in flight 256 at a time, all acknowledged."""
    window = asyncio.Semaphore(256)
    futures = []
    for message, msg_id in messages:
        await window.acquire()
        payload, headers = wire.encode(message), wire.headers_for(message, msg_id)
        future = await bus.js.publish_async(subject, payload, headers=headers)
        future.add_done_callback(lambda _: window.release())
        futures.append(future)
    await asyncio.gather(*futures)


def join_backlog(case: str, num_events: int, num_hot: int) -> list[FeedbackEvent]:
    """Ordinary events (2 per id) with, unless `ordinary`, the flood shuffled in."""
    events = [join_event(f"ev-{i}", f"gen-{i // 2}") for i in range(num_events)]
    if case != "ordinary":
        events += [join_event(f"hot-{i}", HOT_ID) for i in range(num_hot)]
    random.Random(7).shuffle(events)
    return events


def start_joiner(nats_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_url,
        "RLPIPE_FEEDBACK_INGESTER_ROLE": "join",
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": str(free_port()),
        "RLPIPE_LOG_LEVEL": "warning",
    }
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.feedback_ingester"], env=env, stdout=log, stderr=log
        )


async def consumer_state(bus: Bus, spec: ConsumerSpec) -> tuple[int, int]:
    """(messages delivered, messages pending or unacked) of a durable consumer."""
    info = await bus.js.consumer_info(spec.stream, spec.durable)
    return info.delivered.stream_seq or 0, (info.num_pending or 0) + (info.num_ack_pending or 0)


async def wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> float:
    """Poll every 20 ms; the time (Unix s) the condition first held."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if await condition():
            return time.time()
        await asyncio.sleep(0.02)
    raise TimeoutError(f"the joiner: {what}")


async def num_samples(bus: Bus) -> int:
    return (await bus.js.stream_info(streams.ROLLOUTS_ONLINE.name)).state.messages


async def drained(bus: Bus) -> bool:
    states = [await consumer_state(bus, s) for s in (JOINER_FEEDBACK, JOINER_GENERATIONS)]
    return all(busy == 0 for _, busy in states)


async def online_samples(bus: Bus) -> list[OnlineSample]:
    samples = []
    async for msg in scan_stream(bus.js, streams.ROLLOUTS_ONLINE.name, subjects.ROLLOUTS_ONLINE):
        samples.append(wire.decode(OnlineSample, msg.data, msg.headers))
    return samples


async def run_join_case(case: str, num_events: int, num_hot: int, tmp: Path) -> dict[str, Any]:
    """One case on a fresh nats-server: fill the stream, start the joiner, measure."""
    server = NatsServer(store_dir=tmp / case / "nats")
    server.start()
    joiner = None
    cap = JoinConfig().generation_sample_cap
    try:
        bus = await connect_bus(server.url, name="bench-join")
        await provision(bus.js)
        ids = [HOT_ID] if case == "hot_indexed" else []
        ids += [f"gen-{i}" for i in range(num_events // 2)]
        await publish_all(bus, subjects.SERVING_GENERATIONS, [(served(g), g) for g in ids])
        # A first joiner indexes the generations (served before they are rated) and stops;
        # the feedback is stored meanwhile; the joiner measured drains it after a restart.
        joiner = start_joiner(server.url, tmp / f"joiner-{case}-index.log")
        await wait_until(lambda: drained(bus), "did not index the generations (see its log)")
        stop_process(joiner)
        events = join_backlog(case, num_events, num_hot)
        await publish_all(bus, subjects.FEEDBACK_EVENTS, [(e, e.event_id) for e in events])
        joiner = start_joiner(server.url, tmp / f"joiner-{case}.log")
        started_at = await wait_until(
            lambda: _started(bus), "did not start taking events (see its log)"
        )
        expected = num_events + (cap if case == "hot_indexed" else 0)
        await wait_until(lambda: _at_least(bus, expected), "not every sample came")
        drained_at = await wait_until(lambda: drained(bus), "did not drain its consumers")
        flush_s = None
        if case == "hot_waiting":
            published_at = time.time()
            await publish_all(bus, subjects.SERVING_GENERATIONS, [(served(HOT_ID), HOT_ID)])
            await wait_until(lambda: _at_least(bus, num_events + cap), "the flood was not joined")
            # The generation's handler acks once every waiting event is resolved and removed.
            flushed_at = await wait_until(lambda: drained(bus), "the flood was not resolved")
            flush_s = flushed_at - published_at
        samples = await online_samples(bus)
        await bus.close()
    finally:
        if joiner is not None:
            stop_process(joiner)
        server.stop()
    return join_figures(case, samples, len(events), drained_at - started_at, flush_s)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=30)


async def _started(bus: Bus) -> bool:
    return (await consumer_state(bus, JOINER_FEEDBACK))[0] > 0


async def _at_least(bus: Bus, num: int) -> bool:
    return await num_samples(bus) >= num


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages: how much else ran beside the bench."""
    return [round(x, 2) for x in os.getloadavg()]


def join_figures(
    case: str,
    samples: list[OnlineSample],
    num_events: int,
    drain_s: float,
    flush_s: float | None,
) -> dict[str, Any]:
    ordinary = sorted(s.joined_at for s in samples if s.generation.generation_id != HOT_ID)
    hot = [s for s in samples if s.generation.generation_id == HOT_ID]
    span_s = ordinary[-1] - ordinary[0]
    return {
        "case": case,
        "events_in_stream": num_events,
        "ordinary_samples": len(ordinary),
        "ordinary_samples_per_s": len(ordinary) / span_s,
        "ordinary_first_to_last_sample_s": span_s,
        "hot_samples": len(hot),
        "drain_s": drain_s,
        "events_handled_per_s": num_events / drain_s,
        "hot_flush_s": flush_s,
        "load_average_after": load_average(),
    }


async def join_cases(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return {
            case: await run_join_case(case, args.join_events, args.hot_events, Path(tmp))
            for case in ("ordinary", "hot_indexed", "hot_waiting")
        }


# --- the API -------------------------------------------------------------------------------


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


async def api_cases(args: argparse.Namespace) -> dict[str, Any]:
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
    return {"raw_publish_async": raw, "api_single": single, "api_batch": batch}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_average()
    api = {} if args.skip_api else await api_cases(args)
    join = await join_cases(args)
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_before": load_before,
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
            "join_events": args.join_events,
            "hot_events": args.hot_events,
            "generation_sample_cap": JoinConfig().generation_sample_cap,
            "notes": "load generator, ingester (uvicorn) and nats-server share "
            "the machine's cores; 202 = stored in JetStream (file storage); latency per "
            "request; the API's rate limit is the shared one (KV bucket feedback_rate)",
        },
        **api,
        "join": join,
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
    parser.add_argument("--join-events", type=int, default=10000)
    parser.add_argument("--hot-events", type=int, default=10000)
    parser.add_argument(
        "--skip-api", action="store_true", help="the join only; prints, writes no result file"
    )
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    if not args.skip_api:
        print_api(result, args.batch)
    for case in result["join"].values():
        flush_s = case["hot_flush_s"]
        flush = ""
        if flush_s is not None:
            flush = f"; the waiting flood resolved {flush_s:.2f} s after its generation came"
        print(
            f"join {case['case']}: {case['events_handled_per_s']:.0f} events/s "
            f"({case['events_in_stream']} in {case['drain_s']:.1f} s), ordinary samples "
            f"{case['ordinary_samples_per_s']:.0f}/s, {case['hot_samples']} samples from the "
            f"flooded id{flush}"
        )
    if not args.skip_api:
        RESULTS.write_text(result_json(result))
        print(f"wrote {RESULTS}")
    return 0


def print_api(result: dict[str, Any], batch_size: int) -> None:
    raw, single, batch = result["raw_publish_async"], result["api_single"], result["api_batch"]
    print(f"raw publish_async: {raw['msgs_per_s']:.0f} msg/s")
    for name, case in (("single", single), (f"batch of {batch_size}", batch)):
        lat = case["latency_ms"]
        print(
            f"API {name}: {case['events_per_s']:.0f} events/s, {case['requests_per_s']:.0f} req/s,"
            f" p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, statuses {case['statuses']}"
        )


if __name__ == "__main__":
    sys.exit(main())
