"""sparse_add pieces decoded on the device: positions and new values computed where the
weights live, the host only decompressing, checking sizes and counts, and hashing.

On the host a sparse piece is a dozen numpy passes over its changes (gaps to positions, 2-bit
symbols to differences, the add), and a thread holds the GIL between them: byte-0.5b's lr 1e-6
version (11M changes in 33 chunks) decoded in 0.20 s on one thread and no faster than 0.12 s
on any number (H200 host, 16 cores). Here each piece is about twenty kernel launches, and
only its streams go up and its positions and new bits come down (for the output hash).

Every count a kernel relies on is checked on the host first (escaped gaps and escaped
symbols against their escape streams), and the gather of the old values clamps its index,
so a corrupt piece raises CorruptDeltaError instead of tripping a device-side assert, which
would end the process's CUDA context. A position beyond the piece is caught by the caller
from the positions read back (`check_positions`), before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libs.weights.encodings import from_planes
from libs.weights.errors import CorruptDeltaError

# Widths decoded here, and the integer type wide enough for an element and a difference.
_WIDER = {2: torch.int32, 4: torch.int64}
# Pieces with fewer changes are decoded on the host: launches cost more than numpy there.
MIN_CHANGES = 1 << 12
_ESCAPE_PAIRS = np.uint8(0x55)  # the low bit of each 2-bit symbol


def decoded_here(encoding: str, width: int, num_changed: int) -> bool:
    """Whether a piece is decoded on the device by this module."""
    return encoding == "sparse_add" and width in _WIDER and num_changed >= MIN_CHANGES


@dataclass(frozen=True)
class SparseAddStreams:
    """A sparse_add piece's streams, checked on the host: its gap bytes, the excess of its
    escaped gaps (int64), its packed 2-bit symbols, and its escaped codes less 4 (the
    element width's uint)."""

    gap_bytes: np.ndarray
    excess: np.ndarray
    packed: np.ndarray
    escapes: np.ndarray
    size: int  # elements in the piece's range

    @property
    def count(self) -> int:
        return int(self.gap_bytes.size)

    def arrays(self) -> list[np.ndarray]:
        """What goes up to the device, in the order `decode` takes it."""
        return [self.gap_bytes, self.excess, self.packed, self.escapes]


def checked_streams(
    raw: list[np.ndarray], size: int, num_changed: int, width: int
) -> SparseAddStreams:
    """The piece's streams with every count the device decode relies on checked: as many
    gaps as changes, one excess per escaped gap (255), one symbol per change, one escape per
    symbol 3; raises CorruptDeltaError otherwise."""
    if len(raw) != 4:
        raise CorruptDeltaError(f"sparse_add piece has {len(raw)} streams, expected 4")
    gap_bytes, packed = raw[0], raw[2]
    if gap_bytes.size != num_changed:
        raise CorruptDeltaError("decoded change count differs from the piece header")
    excess = from_planes(raw[1], 4)
    if int(np.count_nonzero(gap_bytes == 255)) != excess.size:
        raise CorruptDeltaError("gap escape count does not match the escape stream")
    if packed.size != (num_changed + 3) // 4:
        raise CorruptDeltaError("symbol stream size does not match the change count")
    escapes = from_planes(raw[3], width)
    if _escaped_symbols(packed, num_changed) != escapes.size:
        raise CorruptDeltaError("value escape count does not match the escape stream")
    return SparseAddStreams(gap_bytes, excess.astype(np.int64), packed, escapes, size)


def _escaped_symbols(packed: np.ndarray, count: int) -> int:
    """How many of the first `count` 2-bit symbols are 3 (both bits set)."""
    pairs = packed & (packed >> 1) & _ESCAPE_PAIRS
    if count % 4:  # symbols past `count` in the last byte do not count
        pairs[-1] &= np.uint8((1 << (2 * (count % 4))) - 1)
    return int(np.bitwise_count(pairs).sum())


def decode(
    streams: SparseAddStreams, staged: list[torch.Tensor], old: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int64, relative to the range) and new bits (`old`'s integer dtype) of a
    piece, from its `arrays()` staged on the device (uint8 tensors) and `old`, the range's
    integer view. Exact integer arithmetic in a wider type, as the host decode."""
    gap_bytes, excess, packed, escapes = staged
    count, device = streams.count, old.device
    gaps = gap_bytes.to(torch.int64)
    if streams.excess.size:
        gaps.masked_scatter_(gap_bytes == 255, excess.view(torch.int64) + 255)
    positions = torch.cumsum(gaps, 0).add_(torch.arange(count, device=device))
    width = old.element_size()
    wide, bits = _WIDER[width], 8 * width
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device)
    symbols = ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:count]
    codes = symbols.to(wide) + 1
    if streams.escapes.size:
        signed = escapes.view(old.dtype).to(wide)
        codes.masked_scatter_(symbols == 3, ((signed & mask) + 4) & mask)
    delta = (codes >> 1) ^ -(codes & 1)
    before = old[positions.clamp(max=streams.size - 1)].to(wide)  # checked after the read
    unsigned = (before + delta) & mask
    return positions, ((unsigned + half) & mask).sub_(half).to(old.dtype)


def check_positions(positions: np.ndarray, size: int) -> None:
    """Positions read back lie inside the piece (they increase by construction)."""
    if positions.size and int(positions[-1]) >= size:
        raise CorruptDeltaError("a position lies outside the piece")
