"""Benchmark the GPU path of the delta codec: diff and apply on the device, and the swap pause.

1. A 1B-parameter bf16 state (16 tensors) and the synthetic RL step generated on the device:
   fp32 master N(0, 0.02), AdamW (betas 0.9/0.999, lr 1e-6, no weight decay) on seeded
   N(0, 1e-3) gradients; the delta is between the bf16 weights after steps 2 and 3.
   - diff: compare on the device and bring the changed positions and their old and new bits to
     the host (`device_changes` over every tensor);
   - encode: the whole `encode_device` (diff, patching the host mirror, hashing the target and
     the CPU entropy coder on all cores), checked byte-identical to the CPU `encode`;
   - apply: committing every prepared chunk into the device state in place (scatter per piece)
     and waiting for the device; prepare (gather, decode, check, stage) is timed apart.
   GB/s are model bytes (the bf16 target) per second; times are medians after a warmup.
2. The swap pause of a ~0.5B bf16 model (Qwen2 shapes: hidden 896, 24 layers, intermediate
   4864, vocab 151936, random init) on the device: from the start of committing a prepared
   delta (the same synthetic step on its parameters) until the device is done.
3. The same apply and pause with the CPU codec on host copies, and the CPU scan, for comparison.

    .venv/bin/python bench/weights_gpu_bench.py [--params 1000000000] [--out PATH]

Writes bench/results/<machine>/weights_gpu.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.weights import DeltaApplier, EncodeOptions, VersionInfo, encode
from libs.weights.format import Manifest, encode_chunk, encode_manifest
from libs.weights.gpu import device_diff, encode_device, int_view
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.hashing import state_hash
from libs.weights.scan import changed_elements
from libs.weights.tensors import as_raw, raw_state

State = dict[str, torch.Tensor]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], Any],
    device: torch.device,
    repeats: int,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Median wall time of `repeats` calls after one warmup; `setup` runs untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def synthetic_step(shapes: dict[str, tuple[int, ...]], device: torch.device, seed: int) -> tuple:
    """bf16 weights after AdamW steps 2 and 3 of an fp32 master drawn N(0, 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    master = {
        n: torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02)
        for n, s in shapes.items()
    }
    opt = torch.optim.AdamW(master.values(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    served = []
    for _ in range(3):
        for p in master.values():
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        opt.step()
        served.append({n: p.detach().to(torch.bfloat16) for n, p in master.items()})
    return served[1], served[2]


def same_bits(a: State, b: State) -> bool:
    return all(torch.equal(int_view(a[n]), int_view(b[n])) for n in b)


def host(state: State) -> State:
    return {n: t.cpu() for n, t in state.items()}


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bench_apply(
    base: State, new: State, manifest: Manifest, chunks: list, repeats: int, threads: int
) -> dict:
    """Prepare apart, then the timed commit of every chunk into a copy of `base` in place."""
    device = next(iter(base.values())).device
    state = {n: t.clone() for n, t in base.items()}
    current = VersionInfo(version=2, hash=manifest.base_hash or "")
    on_device = device.type != "cpu"
    make = DeviceDeltaApplier if on_device else DeltaApplier
    holder: dict[str, Any] = {}

    def prepare() -> None:
        for n, t in state.items():
            t.copy_(base[n])
        applier = make(state, manifest, current)
        holder["applier"] = applier
        holder["prepared"] = [applier.prepare(c, check_payload=False) for c in chunks]

    def commit() -> None:
        applier = holder["applier"]
        for prepared in holder["prepared"]:
            applier.commit(prepared)
        applier.finish()  # the device applier waits for the device here

    def prepare_only() -> None:
        applier = make(state, manifest, current)
        [applier.prepare(c, check_payload=False) for c in chunks]

    t_prepare = median_time(prepare_only, device, max(1, repeats // 2))
    t_commit = median_time(commit, device, repeats, setup=prepare)
    assert same_bits(state, new), "applied state differs from the target"
    return {
        "apply_pause_s": t_commit,
        "apply_gbps": nbytes(new) / t_commit / 1e9,
        "prepare_s": t_prepare,
        "num_chunks": len(chunks),
        "num_pieces": sum(len(c.header.pieces) for c in chunks),
        "elements_written": sum(p.num_written for p in holder["prepared"]),
    }


def bench_state(num_params: int, num_tensors: int, device: torch.device, args: Any) -> dict:
    per = num_params // num_tensors
    base, new = synthetic_step(
        {f"layers.{i}.weight": (per,) for i in range(num_tensors)}, device, 0
    )
    model_bytes = nbytes(new)
    t_diff = median_time(lambda: device_diff(base, new, list(new)), device, args.repeats)
    changed = sum(found.positions.size for found in device_diff(base, new, list(new)).values())
    opts = EncodeOptions(threads=args.threads)
    base_host, new_host = host(base), host(new)
    base_hash = state_hash(raw_state(base_host), args.threads)
    holder: dict[str, Any] = {}

    def fresh_mirror() -> None:
        holder["mirror"] = {n: t.clone() for n, t in base_host.items()}

    def run_device_encode() -> None:
        holder["delta"] = encode_device(
            base,
            new,
            holder["mirror"],
            base_version=2,
            version=3,
            options=opts,
            base_hash=base_hash,
        )

    t_encode = median_time(run_device_encode, device, 2, setup=fresh_mirror)
    manifest, chunks = holder["delta"]
    encoded = len(encode_manifest(manifest)) + sum(len(encode_chunk(c)) for c in chunks)
    start = time.perf_counter()
    cpu_delta = encode(
        base_host, new_host, base_version=2, version=3, options=opts, base_hash=base_hash
    )
    t_cpu_encode = time.perf_counter() - start
    identical = encode_manifest(cpu_delta[0]) == encode_manifest(manifest) and [
        encode_chunk(c) for c in cpu_delta[1]
    ] == [encode_chunk(c) for c in chunks]
    assert identical, "device encoder output differs from the CPU encoder's"
    start = time.perf_counter()
    for n in new_host:
        changed_elements(as_raw(base_host[n]).data, as_raw(new_host[n]).data, 2, args.threads)
    t_cpu_scan = time.perf_counter() - start
    out = {
        "num_params": per * num_tensors,
        "num_tensors": num_tensors,
        "model_bytes": model_bytes,
        "density": changed / (per * num_tensors),
        "encoded_bytes": encoded,
        "ratio": model_bytes / encoded,
        "diff_s": t_diff,
        "diff_gbps": model_bytes / t_diff / 1e9,
        "bytes_to_host_in_diff": changed * 8,
        "encode_device_s": t_encode,
        "encode_device_gbps": model_bytes / t_encode / 1e9,
        "encode_identical_to_cpu": identical,
        "cpu_encode_s": t_cpu_encode,
        "cpu_scan_s": t_cpu_scan,
        "cpu_scan_gbps": model_bytes / t_cpu_scan / 1e9,
        "apply": bench_apply(base, new, manifest, chunks, args.repeats, args.threads),
    }
    if args.cpu_apply:
        out["cpu_apply"] = bench_apply(base_host, new_host, manifest, chunks, 3, args.threads)
    return out


def qwen_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Qwen2-0.5B-like model (random init, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=layers, intermediate_size=4864, vocab_size=151936,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def bench_swap(layers: int, device: torch.device, args: Any) -> dict:
    """Pause to commit a prepared delta into a Qwen2-shaped bf16 model in place."""
    shapes = qwen_shapes(layers)
    base, new = synthetic_step(shapes, device, 1)
    mirror = {n: t.cpu().clone() for n, t in base.items()}
    manifest, chunks = encode_device(
        base, new, mirror, base_version=2, version=3, options=EncodeOptions(threads=args.threads)
    )
    out = {
        "model": f"Qwen2 shapes, hidden 896, {layers} layers, vocab 151936, tied, bf16",
        "num_params": sum(t.numel() for t in new.values()),
        "num_tensors": len(new),
        "model_bytes": nbytes(new),
        "density": sum(e.num_changed for e in manifest.tensors)
        / sum(t.numel() for t in new.values()),
        "device": bench_apply(base, new, manifest, chunks, args.repeats, args.threads),
    }
    if args.cpu_apply:
        out["cpu"] = bench_apply(host(base), host(new), manifest, chunks, 3, args.threads)
    return out


def print_table(result: dict) -> None:
    s, q = result["state_1b"], result["swap_05b"]
    ms = lambda t: f"{t * 1e3:.1f} ms"  # noqa: E731
    gbps = lambda r: f"{r:.1f} GB/s"  # noqa: E731
    applied = s["apply"]
    rows = [
        ("diff on device (changes to host)", gbps(s["diff_gbps"]), ms(s["diff_s"])),
        ("encode_device (diff+hash+zstd)", gbps(s["encode_device_gbps"]), ms(s["encode_device_s"])),
        ("apply on device (commit)", gbps(applied["apply_gbps"]), ms(applied["apply_pause_s"])),
        ("prepare on device (not paused)", "", ms(applied["prepare_s"])),
        ("CPU encode (all threads)", "", ms(s["cpu_encode_s"])),
        ("CPU scan (all threads)", gbps(s["cpu_scan_gbps"]), ms(s["cpu_scan_s"])),
        ("0.5B swap pause on device", "", ms(q["device"]["apply_pause_s"])),
    ]  # fmt: skip
    if "cpu_apply" in s:
        cpu = s["cpu_apply"]
        rows.append(("CPU apply (commit)", gbps(cpu["apply_gbps"]), ms(cpu["apply_pause_s"])))
    if "cpu" in q:
        rows.append(("0.5B swap pause on CPU", "", ms(q["cpu"]["apply_pause_s"])))
    print(
        f"device: {result['device_name']}; state: {s['num_params']:,} bf16 params, "
        f"density {s['density']:.4f}, ratio {s['ratio']:.1f}x; 0.5B: {q['num_params']:,}"
    )
    for name, rate, took in rows:
        print(f"  {name:<36} {rate:>12} {took:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=1_000_000_000)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--layers", type=int, default=24, help="Qwen2 layers of the swap model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cpu-apply", dest="cpu_apply", action="store_false")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (no GPU)"
    result = {
        "device_name": name,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "state_1b": bench_state(args.params, args.tensors, device, args),
        "swap_05b": bench_swap(args.layers, device, args),
    }
    out = args.out or result_file("weights_gpu", name if device.type == "cuda" else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(result))
    print_table(result)


if __name__ == "__main__":
    main()
