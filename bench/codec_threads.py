"""How the weight codec's host work scales with threads on this machine (byte-0.5b, bf16).

The trainer's encoder and the rollout-worker's decoder spread a version's chunks over a
thread pool. On a 16-core GPU host the chunk encode on 12 threads took about as long as on
one or two cores of a VM (bench/handover_profile.py): this times, for one
version made as the trainer makes them (fp32 masters, lr 1e-5, published in bf16),

- the chunk encode (`_encode_bodies`) on 1, 2, 4, 8, 12 and 16 threads;
- the worker's prepare of every chunk (`DeviceDeltaApplier.prepare`) on as many threads;
- a control: numpy work alone (subtract, plane split, zstd level 1) on chunk-sized arrays,
  on as many threads, which says whether the host itself scales;

each with the process's user and system CPU seconds and minor page faults, the median of
three runs. `--lr` adds versions made at other learning rates (1e-6: a sparse delta, few
chunks); `--threads` picks the thread counts (on a 2-core VM: --threads 1 2).

    PYTHONPATH=. python3 bench/codec_threads.py [--device cuda] [--lr 1e-5 1e-6]
        [--threads 1 2 4 8 12 16] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from handover_profile import synchronize, versions
from result_file import result_file, result_json

from libs.weights import gpu
from libs.weights.chunking import plan_chunks
from libs.weights.encoder import EncodeOptions, _encode_bodies
from libs.weights.encodings import compress, to_planes
from libs.weights.gpu_apply import DeviceDeltaApplier

THREADS = (1, 2, 4, 8, 12, 16)


def measured(run: Callable[[], Any], device: str) -> dict[str, float]:
    """Median wall time of three runs, with the CPU seconds and faults of the median one."""
    rows = []
    for _ in range(3):
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows.append({"wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
                     "sys_s": after.ru_stime - before.ru_stime,
                     "minor_faults": after.ru_minflt - before.ru_minflt})  # fmt: skip
    rows.sort(key=lambda r: r["wall_s"])
    return {k: round(v, 4) for k, v in rows[1].items()}


def encode_inputs(base: dict, new: dict) -> tuple[dict, dict, list]:
    """What encode_device hands `_encode_bodies`: dense bases, host targets and the plan."""
    mirror = {n: t.cpu().clone() for n, t in base.items()}
    dense, target, _, _, jobs = gpu.device_jobs(base, new, mirror)
    return dense, target, plan_chunks(jobs, EncodeOptions().target())


def control_work(old: np.ndarray) -> int:
    """Numpy and zstd alone on one chunk-sized array (no codec bookkeeping)."""
    planes = to_planes(old - np.uint16(1))
    return len(compress(planes, 1))


def at_threads(
    threads: int,
    device: str,
    encode_input: tuple[dict, dict, list],
    manifest: Any,
    chunks: list,
    state: dict[str, torch.Tensor],
    arrays: list[np.ndarray],
) -> dict[str, dict[str, float]]:
    """The encode, the worker's prepare and the control, each on `threads` threads."""
    dense, target, plans = encode_input
    applier = DeviceDeltaApplier(state, manifest, current=None)

    def encode() -> None:
        _encode_bodies(dense, target, plans, EncodeOptions(threads=threads))

    def prepare() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: applier.prepare(c, check_payload=False), chunks))

    def control() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(control_work, arrays))

    return {"encode": measured(encode, device), "prepare": measured(prepare, device),
            "control": measured(control, device)}  # fmt: skip


def at_learning_rate(device: str, lr: float, thread_counts: list[int]) -> dict[str, Any]:
    """The figures of `at_threads` at each thread count, for a version made at `lr`."""
    base, new = versions(device, lr, 1)
    dense, target, plans = encode_inputs(base, new)
    manifest, chunks = gpu.encode_device(
        base, new, {n: t.cpu().clone() for n, t in base.items()}, base_version=0, version=1,
        options=EncodeOptions(threads=8),
    )  # fmt: skip
    state = {n: t.clone() for n, t in base.items()}
    arrays = [np.random.default_rng(i).integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
              for i in range(len(plans))]  # fmt: skip
    report: dict[str, Any] = {"lr": lr, "chunks": len(chunks), "plans": len(plans)}
    for threads in thread_counts:
        report[str(threads)] = at_threads(threads, device, (dense, target, plans), manifest, chunks,
                                          state, arrays)  # fmt: skip
        print(f"lr {lr:g}", threads, json.dumps(report[str(threads)]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5])
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = args.device
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report: dict[str, Any] = {"card": card, "cpus": len(os.sched_getaffinity(0))}
    for lr in args.lr:
        # The first learning rate's figures at the top level, as before --lr existed.
        at_lr = report if lr == args.lr[0] else report.setdefault(f"lr {lr:g}", {})
        at_lr.update(at_learning_rate(device, lr, args.threads))
    out = args.out or result_file("codec_threads", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(report))


if __name__ == "__main__":
    main()
