"""Benchmark the bus library (publish_many, PullConsumer) against raw nats-py on JetStream.

Starts its own nats-server (JetStream file storage in a temp folder, free port). For each
message size it publishes N messages and then consumes them all, twice over:
- library: `Publisher.publish_many` of `Task` messages whose `prompt` is padded so the
  encoded msgpack body is exactly the stated size, then `PullConsumer` (its defaults) with a
  handler that counts;
- raw: `js.publish_async` of the same body bytes and headers (dedup id + schema), bounded
  by the same number in flight, awaited with `publish_async_completed`, then
  `pull_subscribe` + `fetch(batch)` + `msg.ack()`.
Every (size, client, repeat) gets a fresh stream, deleted afterwards. Figures are the median
of --repeats runs after a short untimed warm-up. Sizes: 1KB = 1024 bytes, 1MB = 1 MiB of body;
throughputs are in MiB/s of body bytes. End-to-end = N / (publish time + consume time).

    .venv/bin/python bench/bus_bench.py [--count-1kb 20000] [--count-1mb 300] [--repeats 3]
    .venv/bin/python bench/bus_bench.py --profile 1KB   # cProfile the library case, no JSON

Writes bench/results/<machine>/bus.json and prints a table and the library/raw ratio line.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from result_file import result_file, result_json

from libs.bus import wire
from libs.bus.connection import connect_bus
from libs.bus.consumer import Delivery, PullConsumer
from libs.bus.provision import ensure_consumer, ensure_stream
from libs.bus.publisher import Outgoing, Publisher
from libs.nats_server import NatsServer
from proto.messages import Task
from proto.streams import ConsumerSpec, StreamSpec

RESULTS = result_file("bus")
MIB = 1024 * 1024
PENDING_BYTES_LIMIT = 256 * MIB  # as PullConsumer sets it, so 1 MiB messages never trip it
FETCH_TIMEOUT_S = 1.0
CLIENTS = ("library", "raw")


@dataclass(frozen=True)
class Case:
    """One message size and how many messages to send."""

    label: str
    body_bytes: int
    count: int


@dataclass(frozen=True)
class Settings:
    """What both clients share: in-flight publishes and the raw fetch batch."""

    max_in_flight: int
    raw_batch: int


def padded_task(body_bytes: int) -> Task:
    """A Task whose msgpack encoding is exactly `body_bytes` long (prompt padded with 'x')."""
    task = Task(task_id="bench", env="bench", prompt="")
    for _ in range(3):  # the str length prefix grows at 256 and 65536 bytes: converge
        missing = body_bytes - len(wire.encode(task))
        task = Task(task_id="bench", env="bench", prompt="x" * (len(task.prompt) + missing))
    assert len(wire.encode(task)) == body_bytes, "padding did not converge"
    return task


async def setup_stream(js: JetStreamContext, name: str) -> StreamSpec:
    """A fresh file stream for one run, sized for 1 MiB messages, with its durable consumer."""
    spec = StreamSpec(
        name=name,
        subjects=(f"bench.{name.lower()}",),
        description="bus_bench run",
        max_msg_bytes=2 * MIB,
    )
    await ensure_stream(js, spec)
    await ensure_consumer(js, consumer_spec(name))
    return spec


def consumer_spec(stream: str) -> ConsumerSpec:
    return ConsumerSpec(stream=stream, durable="bench", description="bus_bench consumer")


async def timed(coro: Awaitable[Any]) -> float:
    start = time.perf_counter()
    await coro
    return time.perf_counter() - start


async def library_publish(
    js: JetStreamContext, subject: str, task: Task, n: int, run: str, settings: Settings
) -> None:
    publisher = Publisher(js, max_in_flight=settings.max_in_flight)
    items = (Outgoing(subject, task, f"{run}-{i}") for i in range(n))
    acks = await publisher.publish_many(items)
    assert len(acks) == n


async def library_consume(js: JetStreamContext, stream: str, n: int) -> None:
    """Consume `n` Tasks through PullConsumer with its default batch and concurrency."""
    done = asyncio.Event()
    seen = 0

    async def on_task(task: Task, delivery: Delivery) -> None:
        nonlocal seen
        seen += 1
        if seen >= n:
            done.set()

    consumer = PullConsumer(js, consumer_spec(stream), Task, on_task, Publisher(js))
    runner = asyncio.create_task(consumer.run())
    await wait_or_fail(done.wait(), runner)
    await consumer.stop(grace_s=5.0)  # lets the last acks go out
    runner.cancel()


async def wait_or_fail(waiting: Awaitable[Any], runner: asyncio.Task[None]) -> None:
    """Wait for `waiting`; if the consumer loop dies first, raise its error."""
    waiter = asyncio.ensure_future(waiting)
    await asyncio.wait({waiter, runner}, return_when=asyncio.FIRST_COMPLETED)
    if not waiter.done():
        waiter.cancel()
        runner.result()
        raise RuntimeError("consumer loop ended before every message arrived")


async def raw_publish(
    js: JetStreamContext, subject: str, body: bytes, headers: dict[str, str], n: int, run: str
) -> None:
    """publish_async, bounded by the context's publish_async_max_pending."""
    for i in range(n):
        await js.publish_async(subject, body, headers={**headers, wire.MSG_ID_HEADER: f"{run}-{i}"})
    await js.publish_async_completed()


async def raw_consume(js: JetStreamContext, stream: str, n: int, batch: int) -> None:
    sub = await js.pull_subscribe(
        "", durable="bench", stream=stream, pending_bytes_limit=PENDING_BYTES_LIMIT
    )
    seen = 0
    while seen < n:
        try:
            msgs = await sub.fetch(batch, timeout=FETCH_TIMEOUT_S)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            await msg.ack()
        seen += len(msgs)
    await sub.unsubscribe()


async def run_once(
    client: str,
    js: JetStreamContext,
    case: Case,
    task: Task,
    settings: Settings,
    run: str,
) -> dict[str, float]:
    """Publish then consume `case.count` messages on a fresh stream; returns the two times."""
    stream = f"BENCH_{client.upper()}_{case.label}"
    spec = await setup_stream(js, stream)
    subject = spec.subjects[0]
    try:
        if client == "library":
            publish_s = await timed(library_publish(js, subject, task, case.count, run, settings))
            consume_s = await timed(library_consume(js, stream, case.count))
        else:
            body, headers = wire.encode(task), wire.headers_for(task, "")
            publish_s = await timed(raw_publish(js, subject, body, headers, case.count, run))
            consume_s = await timed(raw_consume(js, stream, case.count, settings.raw_batch))
        stored = (await js.stream_info(stream)).state.messages
        assert stored == case.count, f"{stream}: {stored} stored, {case.count} published"
    finally:
        await js.delete_stream(stream)
    return {"publish_s": publish_s, "consume_s": consume_s}


def rates(case: Case, seconds: dict[str, float]) -> dict[str, float]:
    """Messages/s and MiB/s of body bytes for each phase in `seconds`."""
    mib = case.count * case.body_bytes / MIB
    out: dict[str, float] = {}
    for name, phase_s in seconds.items():
        out[f"{name}_s"] = phase_s
        out[f"{name}_msgs_per_s"] = case.count / phase_s
        out[f"{name}_mib_per_s"] = mib / phase_s
    return out


async def connect_client(
    client: str, url: str, settings: Settings
) -> tuple[Client, JetStreamContext]:
    if client == "library":
        bus = await connect_bus(url, name="bus-bench-library")
        return bus.nc, bus.js
    nc = await nats.connect(url, name="bus-bench-raw")
    return nc, nc.jetstream(publish_async_max_pending=settings.max_in_flight)


async def bench_case(url: str, case: Case, settings: Settings, repeats: int) -> dict[str, Any]:
    """Warm-up, then `repeats` rounds of library and raw alternately; medians per client."""
    task = padded_task(case.body_bytes)
    contexts = {client: await connect_client(client, url, settings) for client in CLIENTS}
    runs: dict[str, list[dict[str, float]]] = {client: [] for client in CLIENTS}
    try:
        warm = Case(case.label, case.body_bytes, max(10, case.count // 20))
        for client, (_, js) in contexts.items():
            await run_once(client, js, warm, task, settings, f"warm-{client}-{case.label}")
        # Alternating the clients spreads the machine's drift over both.
        for r in range(repeats):
            for client, (_, js) in contexts.items():
                run_id = f"{client}-{case.label}-{r}"
                runs[client].append(await run_once(client, js, case, task, settings, run_id))
    finally:
        for nc, _ in contexts.values():
            await nc.close()
    result: dict[str, Any] = {"body_bytes": case.body_bytes, "count": case.count}
    result.update({client: median_rates(case, runs[client]) for client in CLIENTS})
    result["ratio"] = {
        name: result["library"][f"{name}_msgs_per_s"] / result["raw"][f"{name}_msgs_per_s"]
        for name in ("publish", "consume", "end_to_end")
    }
    return result


def median_rates(case: Case, runs: list[dict[str, float]]) -> dict[str, Any]:
    """Rates from the median time of each phase; end-to-end is the median of the sums."""
    seconds = {
        "publish": statistics.median(r["publish_s"] for r in runs),
        "consume": statistics.median(r["consume_s"] for r in runs),
        "end_to_end": statistics.median(r["publish_s"] + r["consume_s"] for r in runs),
    }
    return {**rates(case, seconds), "runs": runs}


def machine_info(server_version: str) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "nats_server": server_version,
        "nats_py": version("nats-py"),
        "msgspec": version("msgspec"),
    }


async def bench_all(
    url: str, cases: list[Case], settings: Settings, repeats: int
) -> dict[str, Any]:
    nc = await nats.connect(url)
    server_version = str(nc.connected_server_version)
    await nc.close()
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(server_version),
        "settings": {
            "repeats": repeats,
            "max_in_flight": settings.max_in_flight,
            "raw_fetch_batch": settings.raw_batch,
            "library_consumer": "PullConsumer defaults (batch_size 64, concurrency 64)",
            "message": "proto Task, prompt padded so the msgpack body is body_bytes long",
            "units": "MiB = 2**20 bytes of message body; end_to_end = publish then consume",
        },
        "cases": {case.label: await bench_case(url, case, settings, repeats) for case in cases},
    }


def print_summary(result: dict[str, Any]) -> None:
    head = f"{'case':<5} {'client':<8} {'pub msg/s':>10} {'pub MiB/s':>10} "
    head += f"{'con msg/s':>10} {'con MiB/s':>10} {'e2e msg/s':>10} {'e2e MiB/s':>10}"
    print(head)
    for label, case in result["cases"].items():
        for client in CLIENTS:
            f = case[client]
            print(
                f"{label:<5} {client:<8} {f['publish_msgs_per_s']:>10.0f} "
                f"{f['publish_mib_per_s']:>10.1f} {f['consume_msgs_per_s']:>10.0f} "
                f"{f['consume_mib_per_s']:>10.1f} {f['end_to_end_msgs_per_s']:>10.0f} "
                f"{f['end_to_end_mib_per_s']:>10.1f}"
            )
        r = case["ratio"]
        print(
            f"{label:<5} {'lib/raw':<8} {r['publish']:>10.2f} {'':>10} "
            f"{r['consume']:>10.2f} {'':>10} {r['end_to_end']:>10.2f}"
        )
    ratios = ", ".join(
        f"{label} {c['ratio']['end_to_end']:.2f}" for label, c in result["cases"].items()
    )
    print(f"bus ratio (library/raw, end-to-end): {ratios}")


async def profile_library(url: str, case: Case, settings: Settings) -> None:
    """cProfile one library publish and one consume of `case`; print the top functions."""
    nc, js = await connect_client("library", url, settings)
    task = padded_task(case.body_bytes)
    spec = await setup_stream(js, "BENCH_PROFILE")
    phases = {
        "publish": library_publish(js, spec.subjects[0], task, case.count, "prof", settings),
        "consume": library_consume(js, spec.name, case.count),
    }
    for phase, work in phases.items():
        profiler = cProfile.Profile()
        profiler.enable()
        seconds = await timed(work)
        profiler.disable()
        print(f"--- library {phase} of {case.count} x {case.label}: {seconds:.2f} s (profiled)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    await js.delete_stream(spec.name)
    await nc.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count-1kb", type=int, default=20_000, help="messages of 1 KiB")
    parser.add_argument("--count-1mb", type=int, default=300, help="messages of 1 MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case; median")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        help="unacked publishes at a time, both clients (Publisher's default)",
    )
    parser.add_argument("--raw-batch", type=int, default=64, help="raw fetch batch size")
    parser.add_argument("--profile", choices=("1KB", "1MB"), help="cProfile the library instead")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # The library logs through structlog; keep its info lines out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    cases = [Case("1KB", 1024, args.count_1kb), Case("1MB", MIB, args.count_1mb)]
    settings = Settings(max_in_flight=args.max_in_flight, raw_batch=args.raw_batch)
    with tempfile.TemporaryDirectory(prefix="bus-bench-") as tmp:
        server = NatsServer(store_dir=Path(tmp))
        server.start()
        try:
            if args.profile:
                case = next(c for c in cases if c.label == args.profile)
                asyncio.run(profile_library(server.url, case, settings))
                return
            result = asyncio.run(bench_all(server.url, cases, settings, args.repeats))
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result_json(result))
    print_summary(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
