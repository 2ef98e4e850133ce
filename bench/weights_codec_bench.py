"""Benchmark the weight-delta codec on a synthetic RL step, against XOR + shuffle + zstd-1.

The step: an fp32 master copy drawn N(0, 0.02) (seeded), the bf16 weights served are its
rounding; AdamW (betas 0.9/0.999, lr 1e-6, no weight decay) with i.i.d. N(0, 1e-3)
gradients; the delta is between the bf16 weights after steps 2 and 3. Throughputs are
model bytes (the bf16 target) per second, measured on one thread (per core) and on all
threads; each time is the best of --repeats runs.

    .venv/bin/python bench/weights_codec_bench.py [--params 100000000] [--threads 2]

Writes bench/results/weights_codec.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from libs.weights import DeltaApplier, EncodeOptions, VersionInfo, decode, encode
from libs.weights.encodings import from_planes, to_planes
from libs.weights.format import encode_chunk, encode_manifest
from libs.weights.hashing import state_hash
from libs.weights.tensors import raw_state

RESULTS = Path(__file__).parent / "results" / "weights_codec.json"
NUM_TENSORS = 8  # the parameters are split into this many equal tensors, like a model's layers


def synthetic_step(
    num_params: int, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 weights after AdamW steps 2 and 3, as states of NUM_TENSORS tensors."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.nn.Parameter(torch.randn(num_params, generator=gen) * 0.02)
    opt = torch.optim.AdamW([master], lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    served = []
    for _ in range(3):
        master.grad = torch.randn(num_params, generator=gen) * 1e-3
        opt.step()
        served.append(master.detach().to(torch.bfloat16))
    return _split(served[1]), _split(served[2])


def _split(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = torch.tensor_split(flat, NUM_TENSORS)
    return {f"layers.{i}.weight": p.clone() for i, p in enumerate(parts)}


def best_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    """Best wall time of `repeats` calls (setup, untimed, runs before each)."""
    best = float("inf")
    for _ in range(repeats):
        arg = setup() if setup else None
        start = time.perf_counter()
        fn() if setup is None else fn(arg)  # type: ignore[call-arg]
        best = min(best, time.perf_counter() - start)
    return best


def bench_codec(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], threads: int, repeats: int
) -> dict:
    """Size and speed of our codec with `threads` threads."""
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    base_hash = state_hash(raw_state(base), threads)
    opts = EncodeOptions(threads=threads)
    current = VersionInfo(version=2, hash=base_hash)

    def run_encode() -> tuple:
        return encode(base, new, base_version=2, version=3, options=opts, base_hash=base_hash)

    manifest, chunks = run_encode()
    encoded = len(encode_manifest(manifest)) + sum(len(encode_chunk(c)) for c in chunks)
    t_enc = best_time(run_encode, repeats)
    t_hash = best_time(lambda: state_hash(raw_state(new), threads), repeats)

    def fresh() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in base.items()}

    def apply(state: dict[str, torch.Tensor], verify_full: bool = False) -> None:
        applier = DeltaApplier(state, manifest, current)
        applier.apply_all(chunks, threads)
        applier.finish(verify_full, threads)

    t_apply = best_time(apply, repeats, fresh)
    t_apply_full = best_time(lambda s: apply(s, True), repeats, fresh)
    t_decode = best_time(
        lambda: decode(base, manifest, chunks, current=current, threads=threads), repeats
    )
    check = fresh()
    apply(check, True)
    assert all(torch.equal(check[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    encodings: dict[str, int] = {}
    for chunk in chunks:
        for piece in chunk.header.pieces:
            encodings[piece.encoding] = encodings.get(piece.encoding, 0) + 1
    gbps = lambda t: model_bytes / t / 1e9 / threads  # noqa: E731
    return {
        "threads": threads,
        "encoded_bytes": encoded,
        "num_chunks": len(chunks),
        "max_chunk_bytes": max(len(encode_chunk(c)) for c in chunks),
        "piece_encodings": encodings,
        "ratio": model_bytes / encoded,
        "encode_s": t_enc,
        "target_hash_s_within_encode": t_hash,
        "encode_gbps_per_core": gbps(t_enc),
        "apply_inplace_s": t_apply,
        "apply_inplace_gbps_per_core": gbps(t_apply),
        "apply_inplace_full_verify_s": t_apply_full,
        "apply_inplace_full_verify_gbps_per_core": gbps(t_apply_full),
        "decode_copy_s": t_decode,
        "decode_copy_gbps_per_core": gbps(t_decode),
    }


def bench_baseline(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], repeats: int
) -> dict:
    """XOR + byte-plane shuffle + zstd level 1 over each whole tensor, one thread."""
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    old_u = [t.view(torch.int16).numpy().view(np.uint16) for t in base.values()]
    new_u = [t.view(torch.int16).numpy().view(np.uint16) for t in new.values()]

    def run_encode() -> list[bytes]:
        compressor = zstandard.ZstdCompressor(level=1)
        return [
            compressor.compress(to_planes(a ^ b).data) for a, b in zip(old_u, new_u, strict=True)
        ]

    frames = run_encode()

    def run_decode() -> list[np.ndarray]:
        decompressor = zstandard.ZstdDecompressor()
        out = []
        for frame, a in zip(frames, old_u, strict=True):
            flips = from_planes(np.frombuffer(decompressor.decompress(frame), dtype=np.uint8), 2)
            out.append(a ^ flips)
        return out

    assert all(np.array_equal(x, y) for x, y in zip(run_decode(), new_u, strict=True))
    t_enc, t_dec = best_time(run_encode, repeats), best_time(run_decode, repeats)
    encoded = sum(len(f) for f in frames)
    return {
        "threads": 1,
        "encoded_bytes": encoded,
        "ratio": model_bytes / encoded,
        "encode_s": t_enc,
        "encode_gbps_per_core": model_bytes / t_enc / 1e9,
        "decode_s": t_dec,
        "decode_gbps_per_core": model_bytes / t_dec / 1e9,
    }


def main() -> None:
    """Run the benchmark and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, new = synthetic_step(args.params, args.seed)
    changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    runs = [bench_codec(base, new, 1, args.repeats)]
    if args.threads > 1:
        runs.append(bench_codec(base, new, args.threads, args.repeats))
    baseline = bench_baseline(base, new, args.repeats)
    result = {
        "params": args.params,
        "model_bytes": 2 * args.params,
        "density": changed / args.params,
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "codec": runs,
        "baseline_xor_shuffle_zstd1": baseline,
        "ratio_vs_baseline": runs[0]["ratio"] / baseline["ratio"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)


def print_summary(result: dict) -> None:
    """One line per measured configuration."""
    mb = result["model_bytes"] / 1e6
    print(f"params {result['params']:,}  model {mb:.0f} MB  density {result['density']:.4%}")
    for run in result["codec"]:
        print(
            f"codec    threads={run['threads']}: ratio {run['ratio']:.1f}x  "
            f"encode {run['encode_gbps_per_core']:.2f} GB/s/core ({run['encode_s']:.3f}s, "
            f"target hash alone {run['target_hash_s_within_encode']:.3f}s)  "
            f"apply in place {run['apply_inplace_gbps_per_core']:.2f} GB/s/core  "
            f"+full verify {run['apply_inplace_full_verify_gbps_per_core']:.2f}  "
            f"decode to copy {run['decode_copy_gbps_per_core']:.2f}  chunks {run['num_chunks']}"
        )
    base = result["baseline_xor_shuffle_zstd1"]
    print(
        f"baseline threads=1: ratio {base['ratio']:.1f}x  "
        f"encode {base['encode_gbps_per_core']:.2f} GB/s/core  "
        f"decode {base['decode_gbps_per_core']:.2f} GB/s/core"
    )
    print(f"ratio vs baseline: {result['ratio_vs_baseline']:.2f}x")


if __name__ == "__main__":
    main()
