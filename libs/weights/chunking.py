"""Plan which element ranges of which tensors go into which chunk.

Chunks are filled greedily in tensor order up to a target size, estimated before encoding:
a whole range costs its raw bytes (zstd only shrinks it), a delta range costs a per-change
estimate. A big tensor spans several chunks by element ranges; small tensors share one.
The encoder splits any chunk that still comes out above the hard maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libs.weights.scan import Changes

MAX_PIECE_UNITS = (1 << 32) - 1  # gap escapes are uint32, so a piece stays below 2^32 elements
# A dense delta's pieces start at multiples of this many elements: its 2-bit symbols are
# packed 4 per byte, and a tensor packed whole on its GPU is cut into pieces on byte bounds.
ALIGN = 4
PIECE_HEADER_BYTES = 48  # msgpack overhead of a PieceHeader besides its name
# A version is cut into at least this many chunks where they stay above the minimum size
# (parallel_target): a chunk is one thread's work to encode and to decode.
PARALLEL_CHUNKS = 32
MIN_PARALLEL_CHUNK_BYTES = 256 << 10


# Estimated encoded bytes per element of a dense delta, as a fraction of its width, at most:
# the demo's bf16 steps compress about 2.7x (bench/weights_codec_bench.py, --lr 5e-4).
DENSE_BYTES_PER_WIDTH = 0.5


def dense_bytes_per_width(density: float) -> float:
    """Estimated encoded bytes per element of a dense delta whose sampled fraction of changed
    elements is `density`, as a fraction of its width. Most changes of a step are a unit or
    two in the last place: a bf16 step with 14.5% changed (lr 1e-5) codes to about 0.15
    bytes per element (0.07 of the width), so this errs a little high: an estimate of half
    the width made byte-3b's chunks a fifth of the target (2,825 chunks of 200 KB for
    560 MB), each a message to store and fetch."""
    return min(DENSE_BYTES_PER_WIDTH, 0.04 + 0.45 * density)


@dataclass(frozen=True)
class TensorJob:
    """A tensor to send: whole (changes None), as a dense delta (every element, `dense`), or
    as a sparse delta with its changed elements."""

    name: str
    width: int
    numel: int
    changes: Changes | None
    dense: bool = False
    dense_cost: float = DENSE_BYTES_PER_WIDTH  # a dense delta's estimate (dense_bytes_per_width)

    @property
    def positions(self) -> np.ndarray | None:
        """Sorted int64 indices of the changed elements (None: whole or dense)."""
        return None if self.changes is None else self.changes.positions

    def count(self, start: int, stop: int) -> int:
        """Elements sent in [start, stop) (all of them for a whole or dense tensor)."""
        if self.positions is None:
            return stop - start
        left, right = np.searchsorted(self.positions, [start, stop])
        return int(right - left)

    def _element_bytes(self) -> float:
        return self.width * self.dense_cost if self.dense else self.width

    def estimate(self, start: int, stop: int) -> float:
        """Estimated encoded bytes of the range [start, stop)."""
        overhead = PIECE_HEADER_BYTES + len(self.name.encode())
        if self.positions is None:
            return overhead + (stop - start) * self._element_bytes()
        return overhead + self.count(start, stop) * (0.25 + self.width / 2)

    def fit(self, start: int, room: float) -> int:
        """The largest stop (> start) whose range is estimated to fit in `room` bytes; a
        dense delta's pieces start at multiples of ALIGN elements."""
        limit = min(self.numel, start + MAX_PIECE_UNITS)
        if self.dense:
            count = int(room // self._element_bytes()) // ALIGN * ALIGN
            return min(self.numel, start + min(max(ALIGN, count), MAX_PIECE_UNITS // ALIGN * ALIGN))
        if self.positions is None:
            return min(limit, start + max(1, int(room // self._element_bytes())))
        allowed = max(1, int(room // (0.25 + self.width / 2)))
        cut = int(np.searchsorted(self.positions, start)) + allowed
        stop = self.numel if cut >= self.positions.size else int(self.positions[cut])
        return min(limit, stop)


@dataclass(frozen=True)
class PiecePlan:
    """An element range of one tensor assigned to a chunk."""

    job: TensorJob
    start: int
    stop: int


def parallel_target(jobs: list[TensorJob], target_bytes: int) -> int:
    """The chunk fill target for `jobs`: `target_bytes`, or less for a small version, so it
    still makes about PARALLEL_CHUNKS chunks of at least MIN_PARALLEL_CHUNK_BYTES (never
    above `target_bytes`). Chunks are the unit of parallel work on both sides: byte-0.5b's
    lr 1e-6 version (13 MB) made 4 chunks of 4 MiB, for 4 of a 16-core host's threads."""
    total = sum(job.estimate(0, job.numel) for job in jobs)
    return min(target_bytes, max(MIN_PARALLEL_CHUNK_BYTES, int(total // PARALLEL_CHUNKS)))


def plan_chunks(jobs: list[TensorJob], target_bytes: int) -> list[list[PiecePlan]]:
    """Group tensor ranges into chunks of about `target_bytes` estimated encoded bytes."""
    chunks: list[list[PiecePlan]] = []
    current: list[PiecePlan] = []
    room = float(target_bytes)
    for job in jobs:
        start = 0
        while start < job.numel:
            if current and room < target_bytes / 16:
                chunks.append(current)
                current, room = [], float(target_bytes)
            stop = job.fit(start, room)
            current.append(PiecePlan(job, start, stop))
            room -= job.estimate(start, stop)
            start = stop
            if start < job.numel:
                chunks.append(current)
                current, room = [], float(target_bytes)
    if current:
        chunks.append(current)
    return chunks


def split_plan(plan: list[PiecePlan]) -> tuple[list[PiecePlan], list[PiecePlan]]:
    """Halve a chunk plan that encoded too big: by pieces, or one piece by its changes."""
    if len(plan) > 1:
        half = len(plan) // 2
        return plan[:half], plan[half:]
    piece = plan[0]
    middle = _middle(piece)
    if middle <= piece.start or middle >= piece.stop:
        raise ValueError("a single element does not fit in max_chunk_bytes; raise the limit")
    return [PiecePlan(piece.job, piece.start, middle)], [PiecePlan(piece.job, middle, piece.stop)]


def _middle(piece: PiecePlan) -> int:
    positions = piece.job.positions
    if piece.job.dense:
        return piece.start + (piece.stop - piece.start) // 2 // ALIGN * ALIGN
    if positions is None:
        return (piece.start + piece.stop) // 2
    left, right = np.searchsorted(positions, [piece.start, piece.stop])
    if right - left < 2:
        return (piece.start + piece.stop) // 2
    return int(positions[(left + right) // 2])
