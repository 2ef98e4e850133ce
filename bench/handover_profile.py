"""Where a version's handover time goes, part by part, on one GPU (byte-0.5b, bf16).

The trainer encodes each version against the last in a process of its own
(libs/trainer/delta_encoder.py), the rollout-worker decodes it on its GPU
(libs/weights/gpu_apply.py DeviceDeltaApplier). This times each part of both on versions made as
the trainer makes them (fp32 master weights, an AdamW-like step of `lr` times unit noise,
published in bf16), for a sparse step (lr 1e-6) and the GPU loop's default (1e-5):

- in-process: the device scan of densities, the tensors' copies into spare pinned host
  buffers, the device diff, the patch of the host mirror (tensors without a spare buffer),
  the target hash, the chunk encode;
- through the encoder process: the whole round trip as the trainer sees it, and the child's
  own encode (the rest is the hand-over of the tensors between the processes);
- the worker's decode: every chunk prepared (verified, decoded, staged on the device) on
  8 threads, and the commit (the swap pause).

    PYTHONPATH=. python3 bench/handover_profile.py [--threads 12] [--versions 4] [--out F]

GPU only (it runs on CPU with --device cpu, slowly, to check the script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.policy import PolicyConfig, build_policy
from libs.trainer.delta_encoder import DeltaEncoder
from libs.weights import gpu
from libs.weights.chunking import TensorJob, plan_chunks
from libs.weights.encoder import EncodeOptions, _encode_bodies
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.hashing import state_hash, tensor_digests
from libs.weights.tensors import as_raw


def versions(device: str, lr: float, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` + 1 published bf16 states of byte-0.5b, each one step of `lr` from the last."""
    model = build_policy(PolicyConfig(preset="byte-0.5b", device=device, dtype="float32"))
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    generator = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(count + 1):
        out.append({n: t.to(torch.bfloat16) for n, t in master.items()})
        for tensor in master.values():
            noise = torch.randn(tensor.shape, device=device, generator=generator)
            # Adam's steps are at most lr in size, mostly smaller once its moments settle
            tensor.add_(noise, alpha=lr / 4)
    return out


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def in_process_parts(
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    mirror: dict[str, torch.Tensor],
    spare: dict[str, torch.Tensor],
    options: EncodeOptions,
    device: str,
) -> dict[str, float]:
    """encode_device's work, part by part (the same calls in the same order)."""
    parts: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        synchronize(device)
        now = time.perf_counter()
        parts[name] = now - clock
        clock = now

    target, changes = gpu._host_targets(base, new, mirror)
    densities = gpu._device_densities(base, new, list(new))
    lap("densities")
    dense = gpu._dense_deltas(base, new, target, changes)
    copies = gpu._host_copies(new, [n for n in target if changes.get(n) != "whole"], dense, spare)
    target.update({name: as_raw(copy) for name, copy in copies.items()})
    lap("host_copies")
    found = gpu.device_diff(base, new, [n for n in new if n not in changes])
    lap("diff")
    jobs = []
    for name, raw in target.items():
        if name in found:
            if name not in copies:
                raw.units()[found[name].positions] = found[name].new
            changes[name] = "delta" if found[name].positions.size else "same"
        if changes[name] != "same":
            jobs.append(TensorJob(name, raw.width, raw.numel, found.get(name), name in dense))
    lap("mirror_patch")
    tensor_digests(target.values(), options.threads)
    lap("target_hash")
    bodies = _encode_bodies(dense, target, plan_chunks(jobs, options.target()), options)
    lap("chunk_encode")
    spare.update({n: mirror[n] for n in copies})
    mirror.update(copies)
    parts["chunks"] = len(bodies)
    parts["mb"] = sum(len(b.payload) for b in bodies) / 1e6
    parts["dense_tensors"] = len(dense)
    parts["changed_fraction_sampled"] = statistics.fmean(densities.values())
    return parts


async def through_encoder(
    states: list[dict[str, torch.Tensor]], options: EncodeOptions, folder: Path
) -> list[dict[str, float]]:
    """Adopt the first state, encode the rest: the trainer's round trip and the child's part."""
    encoder = DeltaEncoder(folder, options)
    try:
        await encoder.adopt(states[0], 0)
        rows = []
        for version, state in enumerate(states[1:], start=1):
            started = time.perf_counter()
            delta = await encoder.encode(state, version)
            total = time.perf_counter() - started
            rows.append({"round_trip_s": total, "child_encode_s": delta.encode_s,
                         "handoff_s": total - delta.encode_s,
                         "mb": delta.num_bytes / 1e6})  # fmt: skip
            (folder / delta.file_name).unlink()
        return rows
    finally:
        await encoder.close()


def worker_decode(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], device: str, threads: int
) -> dict[str, float]:
    """The worker's side: prepare every chunk on `threads` threads, then commit."""
    mirror = {n: t.cpu().clone() for n, t in base.items()}
    manifest, chunks = gpu.encode_device(
        base, new, mirror, base_version=0, version=1, options=EncodeOptions(threads=threads)
    )
    state = {n: t.clone() for n, t in base.items()}
    synchronize(device)
    started = time.perf_counter()
    applier = DeviceDeltaApplier(state, manifest, current=None)
    opened = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        prepared = list(pool.map(lambda c: applier.prepare(c, check_payload=False), chunks))
    decoded = time.perf_counter()
    for chunk in prepared:
        applier.commit(chunk)
    applier.finish()
    committed = time.perf_counter()
    ok = all(torch.equal(state[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    return {"open_s": opened - started, "prepare_s": decoded - opened,
            "commit_s": committed - decoded, "chunks": len(chunks), "exact": ok}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--switch-interval-ms", type=float, default=None,
        help="sys.setswitchinterval for this process (the in-process parts and the decode)",
    )  # fmt: skip
    parser.add_argument("--no-process", action="store_true", help="skip the encoder process")
    parser.add_argument(
        "--no-spare", action="store_true",
        help="no spare host buffers: every delta tensor patched in the mirror",
    )  # fmt: skip
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    device = args.device
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    options = EncodeOptions(threads=args.threads)
    report: dict[str, Any] = {
        "card": card, "threads": args.threads, "switch_interval_s": sys.getswitchinterval()
    }  # fmt: skip
    for label, lr in (("sparse_lr1e-6", 1e-6), ("default_lr1e-5", 1e-5)):
        states = versions(device, lr, args.versions)
        pinned = device == "cuda"  # as the trainer's encoder keeps them (delta_encoder.py)
        mirror = {n: torch.empty_like(t, device="cpu", pin_memory=pinned).copy_(t)
                  for n, t in states[0].items()}  # fmt: skip
        spare = {n: torch.empty_like(t, pin_memory=pinned) for n, t in mirror.items()}
        if args.no_spare:
            spare = {}
        rows = []
        for v in range(1, len(states)):
            rows.append(in_process_parts(states[v - 1], states[v], mirror, spare, options, device))
        state_hash({n: as_raw(t) for n, t in mirror.items()}, args.threads)
        trips = [{"round_trip_s": 0.0}]
        if not args.no_process:
            with tempfile.TemporaryDirectory() as folder:
                trips = asyncio.run(through_encoder(states, options, Path(folder)))
        decode = worker_decode(states[-2], states[-1], device, 8)
        median = {k: statistics.median(r[k] for r in rows[1:] or rows) for k in rows[0]}
        trip = {k: statistics.median(r[k] for r in trips[1:] or trips) for k in trips[0]}
        report[label] = {"in_process": median, "encoder_process": trip, "worker": decode}
        print(f"{label}: in-process {json.dumps({k: round(v, 4) for k, v in median.items()})}")
        print(f"{label}: encoder process {json.dumps({k: round(v, 4) for k, v in trip.items()})}")
        print(f"{label}: worker {json.dumps(decode)}", flush=True)
        del states
    out = args.out or result_file("handover_profile", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(report))


if __name__ == "__main__":
    main()
