"""The cross-host weight path end to end, without the RL loop: a version of a preset's
weights from the trainer's device to a second copy on a device, through a real nats-server.

For each learning rate (--lr, default 1e-5 and 1e-6):
1. step: the preset's parameters (libs/policy.py's names and shapes; random init N(0, 0.02),
   norms 1, biases 0) as an fp32 master on the device, AdamW (betas 0.9/0.999, no weight
   decay) on seeded N(0, 1e-3) gradients; the version is the bf16 copy after step 3, its
   base the one after step 2 (as bench/weights_codec_bench.py).
2. encode: what the trainer's delta encoder does (libs/trainer/delta_encoder.py):
   `encode_device` against a pinned host mirror of the base with spare pinned buffers, on
   --threads threads; `diff` (the device diff and the copies to the host) is part of it.
3. handoff: the delta file written and read back as the trainer's encoder process and the
   weight-broadcaster do (libs/weights/handoff.py): into the broadcaster's folder in /dev/shm
   (offered before the first run, as the broadcaster does on reading its first delta), read
   memory-mapped; `--handoff disk` keeps it in the staging folder (the fallback where the
   two do not share a host).
4. store: the chunks onto RL_WEIGHT_CHUNKS of a local nats-server (pipelined publish).
5. receive: fetch and decode overlapped per chunk (libs/weights/pipelined.py) against a
   second copy of the base on the device (DeviceDeltaApplier), then `apply` (commit: the
   writes) and finish; `receive_sequential` is the same fetched all first, then decoded.
6. verify: the second copy equals the version bit for bit, and the mirror hashes to the
   manifest's target hash.

GB/s are bytes of the bf16 state per second of the whole path (encode .. apply, medians of
--repeats runs after a warmup). Not in it: the announcement and the worker's notice, and the
swap's wait for generation calls (bench/version_latency.py measures those in a run); the
worker decodes in a process of its own (libs/weights/decode_process.py), here in
--decode-threads threads.

    python bench/weights_delta_path_bench.py          # byte-0.5b and byte-3b on a CUDA device
    .venv/bin/python bench/weights_delta_path_bench.py --preset tiny --device cpu --out /tmp/x.json

Writes bench/results/<card>/weights_delta_path.json (or --out) and prints a table.
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
from pathlib import Path
from typing import Any

import torch
import transformers
from result_file import result_file, result_json

from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import ensure_stream
from libs.bus.publisher import Publisher
from libs.nats_server import NatsServer
from libs.policy import POLICY_PRESETS
from libs.weights import EncodeOptions, VersionInfo
from libs.weights.encoder import DEFAULT_MAX_CHUNK_BYTES, EncodeTimes, chunk_bytes_for
from libs.weights.format import Chunk, Manifest
from libs.weights.gpu import encode_device, int_view
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.handoff import (
    load_staged_delta,
    offer_shm,
    release_shm,
    remove_staged_before,
    write_staged_delta,
)
from libs.weights.hashing import state_hash
from libs.weights.pipelined import fetch_and_prepare
from libs.weights.receiver import ReceiverConfig
from libs.weights.tensors import raw_state
from libs.weights.transport import fetch_chunks, store_chunks
from proto import streams
from proto.messages import WeightsStaged

State = dict[str, torch.Tensor]
PARTS = ("encode", "diff", "handoff", "store", "receive", "fetch", "decode_tail", "apply")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def preset_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a policy preset (built on the meta device: no memory)."""
    config = transformers.AutoConfig.for_model(**POLICY_PRESETS[preset])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def training_step(
    shapes: dict[str, tuple[int, ...]], device: torch.device, lr: float, seed: int
) -> tuple[State, State]:
    """bf16 copies of an fp32 master after AdamW steps 2 and 3 (the base and the version)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for name, shape in shapes.items():
        if "norm" in name:
            value = torch.ones(shape, device=device)
        elif name.endswith(".bias"):
            value = torch.zeros(shape, device=device)
        else:
            value = torch.randn(shape, device=device, generator=gen) * 0.02
        params.append(torch.nn.Parameter(value))
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    copies = []
    for _ in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, device=device, generator=gen) * 1e-3
        optimizer.step()
        named = zip(shapes, params, strict=True)
        copies.append({n: p.detach().to(torch.bfloat16) for n, p in named})
    del optimizer, params
    return copies[1], copies[2]


def pinned_like(state: State, pin: bool) -> State:
    return {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in state.items()}


class VersionPair:
    """One learning rate's base and version, the trainer's mirror and the receiver's copy."""

    def __init__(self, base: State, new: State, device: torch.device) -> None:
        self.base, self.new, self.device = base, new, device
        pin = device.type == "cuda"
        self.mirror = pinned_like(base, pin)
        self.spare = pinned_like(base, pin)
        self.receiver = {n: torch.empty_like(t) for n, t in base.items()}
        self.reset()
        self.base_hash = state_hash(raw_state(self.mirror), os.cpu_count() or 1)

    def reset(self) -> None:
        """The mirror and the receiver's copy back at the base."""
        for name, tensor in self.base.items():
            self.mirror[name].copy_(tensor)
            self.receiver[name].copy_(tensor)
        sync(self.device)


async def one_run(
    path: VersionPair, bus: Bus, options: EncodeOptions, threads: int, staging: Path, version: int
) -> dict[str, Any]:
    """The path once: encode, handoff, store, receive overlapped, apply, verify. Each run is
    a version number of its own (the stream's dedup window remembers a purged one's ids)."""
    path.reset()
    await bus.js.purge_stream(streams.WEIGHT_CHUNKS.name)
    times = EncodeTimes()
    started = time.perf_counter()
    manifest, chunks = encode_device(
        path.base, path.new, path.mirror, base_version=2, version=version, options=options,
        base_hash=path.base_hash, spare=path.spare, times=times,
    )  # fmt: skip
    encoded = time.perf_counter()
    manifest, chunks = await asyncio.to_thread(handoff, staging, manifest, chunks)
    handed = time.perf_counter()
    await store_chunks(Publisher(bus.js, max_in_flight=64), manifest, chunks)
    stored = time.perf_counter()
    current = VersionInfo(version=2, hash=path.base_hash)
    applier = DeviceDeltaApplier(path.receiver, manifest, current)
    receipt = await fetch_and_prepare(bus.nc, manifest, applier, threads=threads)
    received = time.perf_counter()
    applier.commit_all(receipt.prepared, threads)
    applier.finish()
    applied = time.perf_counter()
    row: dict[str, Any] = {
        "encode": encoded - started, "diff": times.diff_s, "handoff": handed - encoded,
        "store": stored - handed, "receive": received - stored, "fetch": receipt.fetch_s,
        "decode_tail": receipt.tail_s, "apply": applied - received, "total": applied - started,
    }  # fmt: skip
    # False where /dev/shm lacked room (or was not offered): the delta went through the disk.
    row["handoff_in_shm"] = (staging / f"v{version}.delta").is_symlink()
    row["exact"] = exact(path.receiver, path.new) and (
        state_hash(raw_state(path.mirror), threads) == manifest.target_hash
    )
    row["sequential_receive"] = await sequential_receive(path, bus, manifest, threads)
    row["encoded_bytes"] = sum(ref.num_bytes for ref in manifest.chunks)
    row["num_chunks"] = len(chunks)
    row["changed_fraction"] = sum(e.num_changed for e in manifest.tensors) / max(
        1, sum(t.numel() for t in path.new.values())
    )
    return row


def handoff(staging: Path, manifest: Manifest, chunks: list[Chunk]) -> tuple[Manifest, Any]:
    """The delta file written and read back (the trainer's encoder to the broadcaster)."""
    remove_staged_before(staging, manifest.version)
    path = write_staged_delta(staging, manifest, chunks)
    message = WeightsStaged(
        version=manifest.version, file_name=path.name, num_bytes=path.stat().st_size,
        created_at=time.time(), kind="delta", base_version=manifest.base_version,
    )  # fmt: skip
    return load_staged_delta(staging, message)


async def sequential_receive(
    path: VersionPair, bus: Bus, manifest: Manifest, threads: int
) -> dict[str, float]:
    """Fetch every chunk, then decode them all, then apply: the receive without overlap,
    each part alone (the fetch's rate with no decode beside it)."""
    receiver = {n: t.clone() for n, t in path.base.items()}
    started = time.perf_counter()
    fetched = await fetch_chunks(bus.nc, manifest)
    fetch_s = time.perf_counter() - started
    applier = DeviceDeltaApplier(receiver, manifest, VersionInfo(version=2, hash=path.base_hash))
    prepared = await asyncio.to_thread(applier.prepare_all, fetched.chunks, threads)
    decode_s = time.perf_counter() - started - fetch_s
    applier.commit_all(prepared.chunks, threads)
    applier.finish()
    seconds = time.perf_counter() - started
    assert exact(receiver, path.new), "the sequential receive is not bit-exact"
    return {"total": seconds, "fetch": fetch_s, "decode": decode_s}


def exact(got: State, want: State) -> bool:
    """Same bits in every tensor (integer views: NaN payloads and -0.0 count as they are)."""
    return all(torch.equal(int_view(got[n]), int_view(want[n])) for n in want)


def summarize(rows: list[dict[str, Any]], model_bytes: int) -> dict[str, Any]:
    median = {p: statistics.median(r[p] for r in rows) for p in (*PARTS, "total")}
    sequential = {
        part: statistics.median(r["sequential_receive"][part] for r in rows)
        for part in ("total", "fetch", "decode")
    }
    last = rows[-1]
    return {
        "model_bytes": model_bytes,
        "encoded_bytes": last["encoded_bytes"],
        "ratio": model_bytes / max(1, last["encoded_bytes"]),
        "num_chunks": last["num_chunks"],
        "changed_fraction": last["changed_fraction"],
        "exact": all(r["exact"] for r in rows),
        "handoff_in_shm": all(r["handoff_in_shm"] for r in rows),
        "seconds": median,
        "state_gbps": model_bytes / median["total"] / 1e9,
        "receive_sequential_s": sequential,
        "runs": rows,
    }


async def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every preset at every learning rate, keyed `<preset>/lr_<lr>`."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="delta-path-bench-") as folder:
        server = NatsServer(store_dir=Path(folder) / "nats")
        server.start()
        try:
            bus = await connect_bus(server.url, name="weights-delta-path-bench")
            await ensure_stream(bus.js, streams.WEIGHT_CHUNKS)
            max_chunk = chunk_bytes_for(bus.nc.max_payload, args.chunk_mib << 20)
            options = EncodeOptions(max_chunk_bytes=max_chunk, threads=args.threads)
            version = 2
            staging = Path(folder) / "weights-staging"
            staging.mkdir()
            if args.handoff == "shm" and offer_shm(staging) is None:
                raise SystemExit("no /dev/shm to hand deltas over in: run with --handoff disk")
            for preset, lr in [(p, lr) for p in args.preset for lr in args.lr]:
                base, new = training_step(preset_shapes(preset), device, lr, seed=0)
                path = VersionPair(base, new, device)
                model_bytes = sum(t.numel() * t.element_size() for t in new.values())
                rows = []
                for i in range(args.repeats + 1):
                    version += 1
                    row = await one_run(path, bus, options, args.decode_threads, staging, version)
                    if args.handoff == "disk":  # reading it offered /dev/shm: withdrawn
                        release_shm(staging)
                    print(f"{preset} lr {lr:g} run {i}: {json.dumps(rounded(row))}", flush=True)
                    rows.append(row)
                results[f"{preset}/lr_{lr:g}"] = summarize(rows[1:] or rows, model_bytes)
                del path, base, new
            remove_staged_before(staging, version + 1)
            release_shm(staging)
            await bus.close()
        finally:
            server.stop()
    return results


def rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", nargs="+", default=["byte-0.5b", "byte-3b"], choices=sorted(POLICY_PRESETS)
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6])
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="encode threads (all cores)"
    )
    parser.add_argument(
        "--decode-threads",
        type=int,
        default=ReceiverConfig().decode_threads,
        help="receive threads (the rollout-worker's default: up to 8; the decode holds the GIL "
        "between numpy calls, and on an H200 host 16 threads decoded byte-0.5b's lr 1e-6 "
        "delta in 0.21 s against 0.16 on 8)",
    )
    parser.add_argument(
        "--chunk-mib", type=int, default=DEFAULT_MAX_CHUNK_BYTES >> 20, help="largest chunk, MiB"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--handoff", choices=["shm", "disk"], default="shm", help="where the delta file goes"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = asyncio.run(measure(args, device))
    report = {
        "card": card, "presets": args.preset, "threads": args.threads,
        "decode_threads": args.decode_threads,
        "cpu_count": os.cpu_count(), "chunk_mib": args.chunk_mib, "handoff": args.handoff,
        "torch": torch.__version__, "python": platform.python_version(),
        "repeats": args.repeats, **results,
    }  # fmt: skip
    out = args.out or result_file("weights_delta_path", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(report))
    print(f"{'version':>18} {'GB/s':>6} {'ratio':>6} " + " ".join(f"{p:>11}" for p in PARTS))
    for key, result in results.items():
        cells = " ".join(f"{result['seconds'][p]:>11.3f}" for p in PARTS)
        print(f"{key:>18} {result['state_gbps']:>6.2f} {result['ratio']:>6.1f} {cells}")
        print(f"{'':>18} total {result['seconds']['total']:.3f} s, exact {result['exact']}, "
              f"handoff in /dev/shm {result['handoff_in_shm']}, "
              f"sequential receive {result['receive_sequential_s']['total']:.3f} s (fetch "
              f"{result['receive_sequential_s']['fetch']:.3f}, decode "
              f"{result['receive_sequential_s']['decode']:.3f})")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
