"""Benchmark the weights relay on loopback: how long a region takes to hold a new version.

Starts a hub nats-server (domain "hub") and a region server (domain "region-a", leaf node of
the hub) in a temporary folder, mirrors the weight streams into the region
(libs/weights/relay.py), then for each size stores a version's worth of incompressible chunks
(7.9 MiB each, the encoder's size) plus an announcement on the hub and measures:

- store_s: publish on the hub until the last ack;
- mirror_s: from the last ack until the region's chunk and announce mirrors hold everything
  (the relay's own delay, on top of storing);
- link_bytes / stored_bytes: bytes the region received over the leaf node link per byte
  stored on the hub (1.0 = exactly one copy).

    .venv/bin/python bench/weights_relay_bench.py [--mb 64 256] [--repeats 3]

Writes bench/results/<machine>/weights_relay.json and prints a table. Loopback shows the relay's
overhead, not a WAN: across regions the link's bandwidth sets mirror_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from result_file import result_file, result_json

from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import provision
from libs.nats_server import NatsServer, binary_version, free_port
from libs.weights.relay import setup_relay
from proto import streams
from proto.subjects import weight_chunk_subject, weights_announce_subject

CHUNK_BYTES = 8 * 1024 * 1024 - 64 * 1024
RELAYED = (streams.WEIGHTS_ANNOUNCE.name, streams.WEIGHT_CHUNKS.name)


def link_bytes_in(region: NatsServer) -> int:
    url = f"http://{region.host}:{region.monitor_port}/leafz"
    with urllib.request.urlopen(url, timeout=2) as reply:
        return int(json.load(reply)["leafs"][0]["in_bytes"])


async def last_seqs(bus: Bus) -> list[int]:
    return [(await bus.js.stream_info(name)).state.last_seq for name in RELAYED]


async def one_version(
    hub_bus: Bus, region_bus: Bus, region: NatsServer, version: int, mb: int
) -> dict[str, float]:
    num_chunks = max(1, mb * 1_000_000 // CHUNK_BYTES)
    bodies = [os.urandom(CHUNK_BYTES) for _ in range(num_chunks)]
    link_before = link_bytes_in(region)
    stored_before = sum([(await hub_bus.js.stream_info(n)).state.bytes for n in RELAYED])
    started = time.perf_counter()
    acks = [
        hub_bus.js.publish(weight_chunk_subject(version, "snapshot", i), body)
        for i, body in enumerate(bodies)
    ]
    await asyncio.gather(*acks)
    await hub_bus.js.publish(weights_announce_subject("snapshot"), b"announcement")
    stored = time.perf_counter()
    want = await last_seqs(hub_bus)
    while any(r < w for r, w in zip(await last_seqs(region_bus), want, strict=True)):
        await asyncio.sleep(0.002)
    mirrored = time.perf_counter()
    stored_bytes = sum([(await hub_bus.js.stream_info(n)).state.bytes for n in RELAYED])
    stored_bytes -= stored_before
    await asyncio.sleep(0.2)  # let the monitor's counters settle
    return {
        "store_s": stored - started,
        "mirror_s": mirrored - stored,
        "link_per_stored": (link_bytes_in(region) - link_before) / stored_bytes,
    }


async def run(sizes_mb: list[int], repeats: int, folder: Path) -> dict[str, Any]:
    hub = NatsServer(folder / "hub", jetstream_domain="hub", leafnode_port=free_port())
    hub.start()
    region = NatsServer(
        folder / "region", jetstream_domain="region-a", leaf_remotes=(hub.leafnode_url,)
    )
    region.start()
    try:
        hub_bus = await connect_bus(hub.url, name="bench-hub")
        region_bus = await connect_bus(region.url, name="bench-region")
        specs = (streams.WEIGHTS_ANNOUNCE, streams.WEIGHT_CHUNKS)
        await provision(hub_bus.js, stream_specs=specs, consumer_specs=(), kv_specs=())
        while True:  # the leaf link comes up a moment after the region starts
            try:
                link_bytes_in(region)
                break
            except (IndexError, KeyError):
                await asyncio.sleep(0.1)
        await setup_relay(region_bus.js, "hub")
        results: dict[str, Any] = {}
        version = 0
        for mb in sizes_mb:
            runs = []
            for _ in range(repeats):
                version += 1
                runs.append(await one_version(hub_bus, region_bus, region, version, mb))
                await hub_bus.js.purge_stream(streams.WEIGHT_CHUNKS.name)
            results[f"{mb}MB"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        await hub_bus.close()
        await region_bus.close()
        return {
            "nats_server": ".".join(map(str, binary_version(hub.binary))),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "repeats": repeats,
            "results": results,
        }
    finally:
        region.stop()
        hub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=result_file("weights_relay"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        report = asyncio.run(run(args.mb, args.repeats, Path(folder)))
    args.out.write_text(result_json(report))
    print(f"{'size':>8} {'store_s':>8} {'mirror_s':>9} {'link/stored':>12}")
    for size, r in report["results"].items():
        print(f"{size:>8} {r['store_s']:8.3f} {r['mirror_s']:9.3f} {r['link_per_stored']:12.3f}")


if __name__ == "__main__":
    main()
