"""Find which elements of a tensor changed, comparing exact bytes (never float values).

The scan compares 8-byte words first (about 9% of words hold a change at 2.3% density in
bf16), then only the changed words element by element, which is several times cheaper
than comparing every element. It returns the old and new values of the changed elements
too, taken from the gathered words, so the encoder never gathers from the tensors again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from libs.weights.tensors import unsigned_dtype

BLOCK_BYTES = 4 << 20  # scan granularity: bounds temporaries, many jobs per thread


@dataclass(frozen=True)
class Changes:
    """Changed elements of a tensor: sorted indices and their old and new values."""

    positions: np.ndarray  # int64 (int32 from the GPU scan, gpu.py, below 2^31 elements)
    old: np.ndarray  # uint elements of the tensor's width
    new: np.ndarray


def changed_elements(old: np.ndarray, new: np.ndarray, width: int, threads: int = 1) -> Changes:
    """The elements whose bytes differ between two uint8 buffers of `width`-byte elements."""
    assert old.size == new.size and old.size % width == 0
    bounds = list(range(0, old.size, BLOCK_BYTES)) or [0]

    def run(start: int) -> Changes:
        end = start + BLOCK_BYTES
        return _scan_block(old[start:end], new[start:end], start // width, width)

    if threads > 1 and len(bounds) > 1:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(run, bounds))
    else:
        parts = [run(start) for start in bounds]
    if len(parts) == 1:
        return parts[0]
    return Changes(
        *(np.concatenate(arrays) for arrays in zip(*(_fields(p) for p in parts), strict=True))
    )


def _fields(changes: Changes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return changes.positions, changes.old, changes.new


def _scan_block(old: np.ndarray, new: np.ndarray, first: int, width: int) -> Changes:
    """Changes (indices offset by `first`) of one block whose size is a width multiple."""
    kind = unsigned_dtype(width)
    if old.size % 8 or width == 8 or old.size < 4096:
        old_u, new_u = old.view(kind), new.view(kind)
        found = np.flatnonzero(old_u != new_u)
        return Changes(found + first, old_u[found], new_u[found])
    old_w, new_w = old.view(np.uint64), new.view(np.uint64)
    words = np.flatnonzero(old_w != new_w)
    old_rows = old_w[words].view(kind).reshape(-1, 8 // width)
    new_rows = new_w[words].view(kind).reshape(-1, 8 // width)
    rows, cols = np.nonzero(old_rows != new_rows)
    positions = words[rows] * (8 // width) + cols + first
    return Changes(positions, old_rows[rows, cols], new_rows[rows, cols])
