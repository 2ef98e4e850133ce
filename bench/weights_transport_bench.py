"""Benchmark the weight transport over loopback NATS against nats-py's Object Store.

A state of incompressible random bytes (so zstd cannot flatter the figure) is encoded as a
snapshot, its chunks stored on RL_WEIGHT_CHUNKS (pipelined publish) and fetched back with N
direct gets in flight, each chunk decoded and its payload hash verified (what a receiver
does before applying). The same bytes go through Object Store put/get in the same run;
Object Store get is quadratic in nats-py (issue #703), so it gets a smaller object
(--object-mb, 64 by default) and our transport is measured at that size too; Object Store
is also measured with the same full-size bytes (--skip-object-full skips it: it takes
minutes). A local nats-server (max_payload 8 MiB) is started in a temporary folder and
stopped at the end.

    .venv/bin/python bench/weights_transport_bench.py [--mb 256] [--object-mb 64]

Writes bench/results/<machine>/weights_transport.json and prints a table. Each figure is the median
of --repeats runs; MB is 10^6 bytes of stored chunk bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
from nats.js import api as js_api
from result_file import result_file, result_json

from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import ensure_stream
from libs.bus.publisher import Publisher
from libs.nats_server import NatsServer
from libs.weights import EncodeOptions, decode, encode_snapshot
from libs.weights.format import Chunk, Manifest, encode_chunk
from libs.weights.tensors import RawTensor
from libs.weights.transport import fetch_chunks, store_chunks
from proto import streams

RESULTS = result_file("weights_transport")
NUM_TENSORS = 8


def random_state(num_bytes: int, seed: int) -> dict[str, RawTensor]:
    """Incompressible bytes split into NUM_TENSORS U8 tensors."""
    rng = np.random.default_rng(seed)
    per = num_bytes // NUM_TENSORS
    return {
        f"layers.{i}.weight": RawTensor("U8", (per,), rng.integers(0, 256, per, np.uint8))
        for i in range(NUM_TENSORS)
    }


async def measure_ours(
    bus: Bus,
    state: dict[str, RawTensor],
    chunk_bytes: int,
    parallels: list[int],
    repeats: int,
    version: int,
) -> dict[str, Any]:
    """Encode, store and fetch (per N) one snapshot; throughputs in MB/s of chunk bytes."""
    options = EncodeOptions(max_chunk_bytes=chunk_bytes, level=1, threads=os.cpu_count() or 1)
    started = time.perf_counter()
    manifest, chunks = encode_snapshot(state, version=version, options=options)
    encode_s = time.perf_counter() - started
    store_s = []
    for attempt in range(repeats):
        await bus.js.purge_stream(streams.WEIGHT_CHUNKS.name)
        # A new version number per attempt, so the dedup window does not drop the bytes.
        m, c = _renumbered(manifest, chunks, version * 100 + attempt)
        result = await store_chunks(Publisher(bus.js, max_in_flight=16), m, c)
        store_s.append(result.seconds)
    stored_bytes = result.num_bytes
    by_mode: dict[str, dict[str, float]] = {"batch": {}, "single": {}}
    for mode, fetch in by_mode.items():
        for parallel in parallels:
            times = []
            for _ in range(repeats):
                fetched = await fetch_chunks(bus.nc, m, parallel=parallel, batch=mode == "batch")
                times.append(fetched.seconds)
            fetch[str(parallel)] = stored_bytes / statistics.median(times) / 1e6
    best = max(parallels, key=lambda n: by_mode["batch"][str(n)])
    started = time.perf_counter()
    fetched = await fetch_chunks(bus.nc, m, parallel=best)
    decode({}, m, fetched.chunks, kind="raw", threads=os.cpu_count() or 1)
    fetch_decode_s = time.perf_counter() - started
    return {
        "model_mb": sum(t.data.size for t in state.values()) / 1e6,
        "stored_mb": stored_bytes / 1e6,
        "chunk_bytes": chunk_bytes,
        "num_chunks": len(chunks),
        "encode_s": encode_s,
        "store_mb_per_s": stored_bytes / statistics.median(store_s) / 1e6,
        "fetch_mb_per_s_by_parallel": by_mode["batch"],
        "single_get_fetch_mb_per_s_by_parallel": by_mode["single"],
        "best_parallel": best,
        "fetch_and_decode_mb_per_s": stored_bytes / fetch_decode_s / 1e6,
    }


def _renumbered(manifest: Manifest, chunks: list[Chunk], version: int) -> tuple[Manifest, list]:
    """The same chunks under another version number (headers and manifest agree)."""
    import msgspec

    new_chunks = [
        msgspec.structs.replace(c, header=msgspec.structs.replace(c.header, version=version))
        for c in chunks
    ]
    refs = [
        msgspec.structs.replace(ref, num_bytes=len(encode_chunk(chunk)))
        for ref, chunk in zip(manifest.chunks, new_chunks, strict=True)
    ]
    return msgspec.structs.replace(manifest, version=version, chunks=refs), new_chunks


async def measure_object_store(bus: Bus, data: bytes, repeats: int) -> dict[str, Any]:
    """nats-py Object Store put and get of `data` (get without writeinto: the common use)."""
    store = await bus.js.create_object_store(
        "bench", config=js_api.ObjectStoreConfig(storage=js_api.StorageType.FILE)
    )
    put_s, get_s = [], []
    for attempt in range(repeats):
        started = time.perf_counter()
        await store.put(f"weights-{attempt}", data)
        put_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        result = await store.get(f"weights-{attempt}")
        get_s.append(time.perf_counter() - started)
        assert result.data == data
    await bus.js.delete_object_store("bench")
    return {
        "mb": len(data) / 1e6,
        "put_mb_per_s": len(data) / statistics.median(put_s) / 1e6,
        "get_mb_per_s": len(data) / statistics.median(get_s) / 1e6,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    parallels = [int(n) for n in args.parallel.split(",")]
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as folder:
        server = NatsServer(store_dir=Path(folder))
        server.start()
        try:
            bus = await connect_bus(server.url, name="weights-transport-bench")
            await ensure_stream(bus.js, streams.WEIGHT_CHUNKS)
            big = random_state(args.mb * 1_000_000, seed=0)
            small = random_state(args.object_mb * 1_000_000, seed=1)
            ours = {}
            for chunk_mib in (1, 4):
                key = f"{args.mb}mb_chunk{chunk_mib}mib"
                ours[key] = await measure_ours(
                    bus, big, chunk_mib << 20, parallels, args.repeats, 1 + chunk_mib
                )
                print(f"measured {key}", flush=True)
            ours[f"{args.object_mb}mb_chunk1mib"] = await measure_ours(
                bus, small, 1 << 20, parallels, args.repeats, 9
            )
            raw = b"".join(t.data.tobytes() for t in small.values())
            object_store = await measure_object_store(bus, raw, args.object_repeats)
            print(f"measured Object Store at {args.object_mb} MB", flush=True)
            object_store_full = None
            if not args.skip_object_full:
                # The same bytes our transport moved (slow: its get is quadratic in size).
                raw = b"".join(t.data.tobytes() for t in big.values())
                object_store_full = await measure_object_store(bus, raw, 1)
                print(f"measured Object Store at {args.mb} MB", flush=True)
            await bus.close()
        finally:
            server.stop()
    same_size = ours[f"{args.object_mb}mb_chunk1mib"]
    best_same = max(same_size["fetch_mb_per_s_by_parallel"].values())
    best_big = max(ours[f"{args.mb}mb_chunk1mib"]["fetch_mb_per_s_by_parallel"].values())
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "nats_py": package_version("nats-py"),
            "nats_server": server.binary,
            "network": "loopback",
        },
        "ours": ours,
        "object_store": object_store,
        "object_store_full_size": object_store_full,
        "get_speedup_vs_object_store_same_size": best_same / object_store["get_mb_per_s"],
        "get_speedup_vs_object_store_ours_full_size": best_big / object_store["get_mb_per_s"],
        "get_speedup_same_bytes_full_size": (
            best_big / object_store_full["get_mb_per_s"] if object_store_full else None
        ),
        "note": (
            f"Object Store measured with {args.object_mb} MB and with the same {args.mb} MB our "
            f"transport moved (its get is quadratic in size); ours at {args.mb} MB and at "
            f"{args.object_mb} MB. Fetch = batch direct gets (or one "
            "get per chunk) + msgpack decode + payload hash check; fetch_and_decode adds "
            "decoding into a new state. The 2 cores are shared with the server and other work."
        ),
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'transfer':<34} {'MB':>6} {'store MB/s':>11} {'fetch MB/s by N in flight':>30}")
    for key, row in result["ours"].items():
        fetch = "  ".join(f"{n}:{v:.0f}" for n, v in row["fetch_mb_per_s_by_parallel"].items())
        label = f"ours {key}"
        print(f"{label:<34} {row['stored_mb']:>6.0f} {row['store_mb_per_s']:>11.0f}   {fetch}")
        single = row["single_get_fetch_mb_per_s_by_parallel"]
        print(
            f"{'  (one chunk per get)':<53}   "
            + "  ".join(f"{n}:{v:.0f}" for n, v in single.items())
        )
        print(
            f"{'':<34} encode {row['encode_s']:.2f} s, fetch+decode at N={row['best_parallel']}: "
            f"{row['fetch_and_decode_mb_per_s']:.0f} MB/s"
        )
    obj = result["object_store"]
    print(
        f"{'nats-py Object Store':<34} {obj['mb']:>6.0f} {obj['put_mb_per_s']:>11.1f}   "
        f"get: {obj['get_mb_per_s']:.1f}"
    )
    speedup = result["get_speedup_vs_object_store_same_size"]
    print(f"get speedup over Object Store (same size): {speedup:.0f}x")
    full = result["object_store_full_size"]
    if full is not None:
        print(
            f"{'nats-py Object Store':<34} {full['mb']:>6.0f} {full['put_mb_per_s']:>11.1f}   "
            f"get: {full['get_mb_per_s']:.1f}"
        )
        same = result["get_speedup_same_bytes_full_size"]
        print(f"get speedup over Object Store (the same {full['mb']:.0f} MB): {same:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the transferred state")
    parser.add_argument("--object-mb", type=int, default=64, help="size for Object Store")
    parser.add_argument("--parallel", default="1,2,4,8,16", help="N values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--object-repeats", type=int, default=1)
    parser.add_argument(
        "--skip-object-full",
        action="store_true",
        help="skip Object Store at the full size (minutes: its get is quadratic)",
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(result_json(result))
    print_table(result)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
