"""Per-piece encodings: how an element range of one tensor becomes zstd-compressed streams.

Elements are unsigned integers of the dtype's width (1, 2, 4 or 8 bytes); every transform
is exact integer arithmetic or XOR, so decoding reproduces every bit pattern.

- sparse (positions): gaps between changed elements, one byte each (255 = escape, the
  excess goes to a uint32 escape stream split into byte planes).
- sparse_add values: zigzag of (new - old) mod 2^bits. Changed bf16/fp16/fp32 weights
  mostly move by a few units in the last place, so z in {1, 2, 3} is coded as a 2-bit
  symbol, packed 4 per byte (zstd's Huffman cannot spend under 1 bit on a byte); larger
  z go to an escape stream as byte planes.
- sparse_xor values: byte planes of (new ^ old) (wins for bool/int flips).
- dense_add: zigzag(new - old) of every element of the range, no positions: codes 0, 1 and
  2 as 2-bit symbols packed 4 per byte, 3 marking an escape, and the escapes (code - 3, in
  element order) as byte planes. For a tensor where many elements change (an RL step at
  lr 1e-5 moves 15% of byte-3b's bf16 weights, nearly all by one unit in the last place;
  at the demo's rate nearly every one by several) the sparse forms spend a position per
  change and a scan per tensor. The packed symbols are a quarter of the elements' count in
  bytes: zstd codes them 5x faster and decodes them 8x faster than the low byte plane of
  the codes, and smaller (bf16 at lr 1e-5, one core: 0.11 bytes per element in 0.85 ns,
  against 0.20 in 4.5 ns). Pieces start at multiples of 4 elements (chunking.py), so the
  packing of a whole tensor (on its GPU: libs/weights/gpu.py) cuts into its pieces' streams.
- dense_xor: byte planes of (new ^ old) over the whole range (wins when most elements change).
- raw: byte planes of new (new or reshaped tensors, snapshots).

The dense encodings keep each byte plane as a stream of its own, and every stream is
zstd-compressed only where that pays: a stream zstd would not shrink by STORED_UNLESS_SAVES
(a bf16 mantissa plane of a snapshot or of a large step is noise) is stored as it is, which
its header says by a compressed size equal to its raw size (a compressed stream is always
smaller: `pack_stream`). A stored stream costs neither side a zstd pass, and decodes as a
view of the payload. Above SAMPLE_BYTES a stream is first judged on a sample, so a noise
plane is not compressed whole only to be thrown away.

The encoder measures the candidates and keeps the smallest; dense ones are only tried when
more than 1/8 of the elements changed, below which the sparse forms always won in our runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zstandard

from libs.weights.errors import CorruptDeltaError
from libs.weights.format import Encoding
from libs.weights.targets import ElementRange
from libs.weights.tensors import unsigned_dtype

DENSE_TRY_FRACTION = 1 / 8
# A stream is stored uncompressed unless zstd saves at least this fraction of its bytes: on
# the 16 cores of an H200 host zstd level 1 runs at about 0.6-0.9 GB/s per core each way, so
# a stream it shrinks by less costs more in coding than it saves on the bus.
STORED_UNLESS_SAVES = 1 / 8
SAMPLE_BYTES = 64 << 10  # judged on 4 spread slices of 16 KiB first, when 4x longer than this
# zstd level of dense_add pieces. On the planes of a demo-rate bf16 step (lr 5e-4, 8M
# params) level 1 kept level 3's ratio (2.92 vs 2.88) at 1.4 GB/s instead of 0.23.
DENSE_ZSTD_LEVEL = 1
# Encodings that write every element of their range (no positions stream).
DENSE_ENCODINGS = ("raw", "dense_xor", "dense_add")
SAMPLE_CHANGES = 1 << 16
# A packed byte -> its four 2-bit symbols as the bytes of a little-endian uint32.
_UNPACK_2BIT = np.array(
    [sum(((byte >> (2 * k)) & 3) << (8 * k) for k in range(4)) for byte in range(256)], dtype="<u4"
)
_PACK_2BIT = (1 << 24) | (1 << 18) | (1 << 12) | (1 << 6)
_NONZERO_SYMBOL_BITS = np.uint64(0x5555555555555555)  # the low bit of each 2-bit symbol


@dataclass(frozen=True)
class EncodedPiece:
    """Compressed streams of one piece and what it writes (for the chunk's output hash)."""

    encoding: Encoding
    streams: list[bytes | memoryview]  # compressed, or stored (as long as the raw stream)
    raw_sizes: list[int]
    num_changed: int

    @property
    def num_bytes(self) -> int:
        """Total compressed size."""
        return sum(len(s) for s in self.streams)


@dataclass(frozen=True)
class Written:
    """What decoding a piece wrote: positions relative to the piece (None = all) and bytes."""

    positions: np.ndarray | None
    values: np.ndarray


# ---- byte-level helpers -------------------------------------------------------------


class _ThreadContexts(threading.local):
    """This thread's zstd contexts, made once and used for every stream after (a context
    serves one call at a time, hence one per thread; a one-shot call resets it, so the
    bytes are those of a fresh one). A version of byte-0.5b is about 1,300 streams, and a
    context per stream costs a sparse delta's encode and decode a tenth or more."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        found = self.compressors.get(level)
        if found is None:
            found = self.compressors[level] = zstandard.ZstdCompressor(level=level)
        return found


_CONTEXTS = _ThreadContexts()


def compress(data: np.ndarray, level: int) -> bytes:
    """zstd-compress a uint8 buffer; empty stays empty."""
    if data.size == 0:
        return b""
    return _CONTEXTS.compressor(level).compress(data.data)


def pack_stream(data: np.ndarray, level: int) -> bytes | memoryview:
    """A stream's bytes in the payload: zstd-compressed where that saves at least
    STORED_UNLESS_SAVES of them, else the bytes as they are (stored: as long as the raw
    stream, which no compressed stream kept here is)."""
    if data.size == 0:
        return b""
    if data.size >= 4 * SAMPLE_BYTES and not _pays(_sample(data), level):
        return _stored(data)
    packed = compress(data, level)
    if len(packed) <= data.size * (1 - STORED_UNLESS_SAVES):
        return packed
    return _stored(data)


def _stored(data: np.ndarray) -> memoryview:
    """The stream's bytes as they are (a view: the chunk's join is their one copy)."""
    return np.ascontiguousarray(data, dtype=np.uint8).data.cast("B")


def _sample(data: np.ndarray) -> np.ndarray:
    """Four slices of SAMPLE_BYTES / 4 spread over the stream, concatenated."""
    part = SAMPLE_BYTES // 4
    step = (data.size - part) // 3
    return np.concatenate([data[i * step : i * step + part] for i in range(4)])


def _pays(sample: np.ndarray, level: int) -> bool:
    return len(compress(sample, level)) <= sample.size * (1 - STORED_UNLESS_SAVES)


def is_stored(stream_size: int, raw_size: int) -> bool:
    """Whether a stream of a piece is stored uncompressed (see the module docstring)."""
    return stream_size == raw_size


def decompress(data: bytes | memoryview, raw_size: int) -> np.ndarray:
    """The stream's `raw_size` bytes: itself when stored (a read-only view, no copy), else
    zstd-decompressed to exactly that size, or CorruptDeltaError."""
    if is_stored(len(data), raw_size):
        return np.frombuffer(data, dtype=np.uint8)
    try:
        out = _CONTEXTS.decompressor.decompress(data, max_output_size=raw_size)
    except zstandard.ZstdError as exc:
        raise CorruptDeltaError(f"stream does not decompress: {exc}") from exc
    if len(out) != raw_size:
        raise CorruptDeltaError(f"stream decompressed to {len(out)} bytes, expected {raw_size}")
    return np.frombuffer(out, dtype=np.uint8)


def to_planes(values: np.ndarray) -> np.ndarray:
    """Byte-plane split: all byte 0s, then all byte 1s, ... (uint8, same size)."""
    width = values.dtype.itemsize
    if width == 1:
        return values.view(np.uint8)
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T).reshape(-1)


def plane_streams(values: np.ndarray) -> list[np.ndarray]:
    """Each byte plane of the values as a stream of its own (one for 1-byte elements)."""
    planes = to_planes(values)
    count = values.size
    return [planes[i * count : (i + 1) * count] for i in range(values.dtype.itemsize)]


def from_plane_streams(streams: list[np.ndarray], width: int, count: int) -> np.ndarray:
    """Inverse of plane_streams: `count` little-endian uints of `width` bytes."""
    if len(streams) != width or any(s.size != count for s in streams):
        sizes = [int(s.size) for s in streams]
        raise CorruptDeltaError(f"plane streams of {sizes} bytes for {count} elements of {width}")
    values = np.empty(count, dtype=unsigned_dtype(width))
    out_bytes = values.view(np.uint8)
    for plane, stream in enumerate(streams):
        out_bytes[plane::width] = stream
    return values


def from_planes(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of to_planes: uint8 planes back to little-endian uints of `width` bytes."""
    if planes.size % width:
        raise CorruptDeltaError(f"plane stream of {planes.size} bytes is not a multiple of {width}")
    count = planes.size // width
    values = np.empty(count, dtype=unsigned_dtype(width))
    # One strided write per plane: 2.6x the speed of a transposing copy for 2-byte elements.
    out_bytes = values.view(np.uint8)
    for plane in range(width):
        out_bytes[plane::width] = planes[plane * count : (plane + 1) * count]
    return values


# ---- positions ----------------------------------------------------------------------


def encode_positions(positions: np.ndarray) -> list[np.ndarray]:
    """Gap bytes and the uint32 escape planes for sorted relative positions."""
    gaps = np.empty(positions.size, dtype=np.int64)
    gaps[:1] = positions[:1]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    gap_bytes = np.empty(positions.size, dtype=np.uint8)
    np.minimum(gaps, 255, out=gap_bytes, casting="unsafe")
    excess = gaps[gap_bytes == 255] - 255
    return [gap_bytes, to_planes(excess.astype("<u4"))]


def decode_positions(gap_bytes: np.ndarray, excess_planes: np.ndarray, length: int) -> np.ndarray:
    """Relative int64 positions from gap streams, checked to lie inside [0, length)."""
    gaps = gap_bytes.astype(np.int64)
    escaped = gap_bytes == 255
    excess = from_planes(excess_planes, 4)
    if excess.size != int(escaped.sum()):
        raise CorruptDeltaError("gap escape count does not match the escape stream")
    gaps[escaped] += excess
    positions = np.cumsum(gaps + 1) - 1
    if positions.size and positions[-1] >= length:
        raise CorruptDeltaError("a position lies outside the piece")
    return positions


# ---- values -------------------------------------------------------------------------


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map wrapped differences (uint) to small unsigned codes: 0,-1,1,-2 -> 0,1,2,3."""
    bits = diff.dtype.itemsize * 8
    signed = diff.view(f"<i{diff.dtype.itemsize}")
    return ((signed << 1) ^ (signed >> (bits - 1))).view(diff.dtype)


def unzigzag(codes: np.ndarray) -> np.ndarray:
    """Inverse of zigzag, in the same unsigned dtype."""
    return (codes >> 1) ^ np.negative(codes & 1)


def encode_add_values(old: np.ndarray, new: np.ndarray) -> list[np.ndarray]:
    """2-bit symbols (packed 4 per byte) and escape planes for zigzag(new - old)."""
    codes = zigzag(new - old)
    symbols = np.zeros((codes.size + 3) // 4 * 4, dtype=np.uint8)
    np.minimum(codes - 1, 3, out=symbols[: codes.size], casting="unsafe")
    escapes = codes[symbols[: codes.size] == 3] - 4
    # Symbols s0..s3 (< 4) as one little-endian uint32: the product's top byte is
    # s0 | s1 << 2 | s2 << 4 | s3 << 6, and the lower partial products stay below 2^24.
    quads = symbols.view("<u4") * np.uint32(_PACK_2BIT)
    quads >>= 24
    return [quads.astype(np.uint8), to_planes(escapes)]


def decode_add_values(old: np.ndarray, packed: np.ndarray, escape_planes: np.ndarray) -> np.ndarray:
    """New values from old values and the sparse_add value streams."""
    count = old.size
    if packed.size != (count + 3) // 4:
        raise CorruptDeltaError("symbol stream size does not match the change count")
    symbols = _UNPACK_2BIT.take(packed).view(np.uint8)[:count]
    codes = symbols.astype(old.dtype)
    codes += old.dtype.type(1)
    escaped = (symbols == 3).nonzero()[0]
    escapes = from_planes(escape_planes, old.dtype.itemsize)
    if escapes.size != escaped.size:
        raise CorruptDeltaError("value escape count does not match the escape stream")
    codes[escaped] = escapes + old.dtype.type(4)
    return old + unzigzag(codes)


# ---- piece encode / decode ----------------------------------------------------------


def _pack(encoding: Encoding, raw: list[np.ndarray], num_changed: int, level: int) -> EncodedPiece:
    streams = [pack_stream(r, level) for r in raw]
    return EncodedPiece(encoding, streams, [int(r.size) for r in raw], num_changed)


def encode_whole(new: np.ndarray, level: int) -> EncodedPiece:
    """A piece sent in full: byte planes of the new elements."""
    return _pack("raw", plane_streams(new), new.size, level)


def encode_dense_add(old: np.ndarray, new: np.ndarray, level: int) -> EncodedPiece:
    """A piece of a densely changed range: the packed symbols and escape planes of
    zigzag(new - old), every element (see the module docstring)."""
    packed, escapes = pack_codes(zigzag(new - old))
    return dense_add_piece(packed, escapes, new.size, level)


def pack_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2-bit symbols min(code, 3) packed 4 per byte (element 4i + k in bits 2k, 2k + 1 of
    byte i; zeros pad the last byte), and the escapes code - 3 of the codes >= 3, in order."""
    symbols = np.zeros((codes.size + 3) // 4 * 4, dtype=np.uint8)
    np.minimum(codes, 3, out=symbols[: codes.size], casting="unsafe")
    escapes = codes[symbols[: codes.size] == 3] - codes.dtype.type(3)
    quads = symbols.view("<u4") * np.uint32(_PACK_2BIT)  # see encode_add_values
    quads >>= 24
    return quads.astype(np.uint8), escapes


def dense_add_piece(packed: np.ndarray, escapes: np.ndarray, size: int, level: int) -> EncodedPiece:
    """The dense_add piece of `size` elements from its packed symbols and escapes, wherever
    they were made; compressed at zstd level at most DENSE_ZSTD_LEVEL."""
    num_changed = nonzero_symbols(packed)  # the padding symbols are zeros
    streams = [packed, *plane_streams(escapes)]
    return _pack("dense_add", streams, num_changed, min(level, DENSE_ZSTD_LEVEL))


def nonzero_symbols(packed: np.ndarray) -> int:
    """How many of the 2-bit symbols packed 4 per byte are not 0: a popcount of each
    symbol's two bits ORed, 8 bytes at a time (np.bincount casts every byte to int64 first:
    ten times slower, 40 ms for a 4 MiB chunk's 9 MB of symbols on one core)."""
    whole = packed.size // 8 * 8
    words = np.ascontiguousarray(packed[:whole]).view(np.uint64)
    tail = packed[whole:].astype(np.uint64)  # the last few bytes, one a word
    count = 0
    for part in (words, tail):
        either = (part | (part >> np.uint64(1))) & _NONZERO_SYMBOL_BITS
        count += int(np.bitwise_count(either).sum(dtype=np.int64))
    return count


def unpack_codes(streams: list[np.ndarray], size: int, width: int) -> np.ndarray:
    """The zigzag codes of a dense_add piece of `size` elements of `width` bytes from its
    streams (packed symbols, then one escape plane per byte), checked."""
    if len(streams) != 1 + width:
        raise CorruptDeltaError(f"dense_add piece has {len(streams)} streams, expected {1 + width}")
    packed = streams[0]
    if packed.size != (size + 3) // 4:
        raise CorruptDeltaError(f"{packed.size} bytes of symbols for {size} elements")
    symbols = _UNPACK_2BIT.take(packed).view(np.uint8)[:size]
    codes = symbols.astype(unsigned_dtype(width))
    escaped = (symbols == 3).nonzero()[0]
    escapes = from_plane_streams(streams[1:], width, escaped.size)
    codes[escaped] = escapes + codes.dtype.type(3)
    return codes


@dataclass(frozen=True)
class DenseCodes:
    """A tensor's dense_add codes packed elsewhere (on its GPU: `libs.weights.gpu`): the
    packed symbols of every element, and the escapes with their element positions, exactly
    what `encode_dense_add` computes on the host for a range starting at a multiple of 4."""

    packed: np.ndarray  # uint8, (numel + 3) // 4
    positions: np.ndarray  # int64, sorted: the elements whose code is >= 3
    escapes: np.ndarray  # their code - 3, the tensor's unsigned dtype
    numel: int

    def encode(self, start: int, stop: int, level: int) -> EncodedPiece:
        """The dense_add piece of elements [start, stop), as `encode_dense_add` makes it."""
        assert start % 4 == 0 and (stop % 4 == 0 or stop == self.numel), (start, stop)
        left, right = np.searchsorted(self.positions, [start, stop])
        packed = self.packed[start // 4 : (stop + 3) // 4]
        return dense_add_piece(packed, self.escapes[left:right], stop - start, level)


def encode_delta(
    old: np.ndarray | None,
    new: np.ndarray,
    positions: np.ndarray,
    old_vals: np.ndarray,
    new_vals: np.ndarray,
    level: int,
) -> EncodedPiece:
    """The smallest encoding, by measurement, of the range old -> new.

    `positions` are the changed elements (relative to the range) and `old_vals`/`new_vals`
    their values. Sparse value streams are compared on a sample of up to 64 Ki changes,
    then only the winner is compressed whole (a piece of no more changes than the sample is
    its own sample: the winner's streams are kept, not compressed again; at lr 1e-6 most of
    byte-0.5b's pieces are, and the compares were half of the chunk encode). `old` None: the
    base range is rebuilt from `new` and the changed values when a dense form is tried (the
    GPU path keeps no base copy).
    """
    pos_raw = encode_positions(positions)
    pos_streams = [pack_stream(s, level) for s in pos_raw]
    value_forms: dict[Encoding, Callable[[np.ndarray, np.ndarray], list[np.ndarray]]] = {
        "sparse_add": lambda o, n: encode_add_values(o, n),
        "sparse_xor": lambda o, n: [to_planes(o ^ n)],
    }
    sample = slice(0, SAMPLE_CHANGES)
    measured: dict[Encoding, tuple[list[np.ndarray], list[bytes | memoryview]]] = {}
    for form, encode_values in value_forms.items():
        raw = encode_values(old_vals[sample], new_vals[sample])
        measured[form] = (raw, [pack_stream(r, level) for r in raw])
    best = min(measured, key=lambda e: sum(len(c) for c in measured[e][1]))
    value_raw, value_streams = measured[best]
    if positions.size > SAMPLE_CHANGES:  # the sample was a prefix: the whole range, once
        value_raw = value_forms[best](old_vals, new_vals)
        value_streams = [pack_stream(r, level) for r in value_raw]
    candidates = [_sparse(best, pos_raw, pos_streams, value_raw, value_streams)]
    if positions.size > new.size * DENSE_TRY_FRACTION:
        if old is None:
            old = new.copy()
            old[positions] = old_vals
        candidates.append(_pack("dense_xor", plane_streams(old ^ new), positions.size, level))
        candidates.append(_pack("raw", plane_streams(new), positions.size, level))
    return min(candidates, key=lambda c: c.num_bytes)


def _sparse(
    encoding: Encoding,
    pos_raw: list[np.ndarray],
    pos_streams: list[bytes | memoryview],
    value_raw: list[np.ndarray],
    value_streams: list[bytes | memoryview],
) -> EncodedPiece:
    sizes = [int(r.size) for r in pos_raw + value_raw]
    return EncodedPiece(encoding, pos_streams + value_streams, sizes, int(pos_raw[0].size))


def piece_positions(
    encoding: Encoding, raw: list[np.ndarray], size: int, num_changed: int
) -> np.ndarray | None:
    """The relative positions a piece writes (None: every element of a dense encoding),
    decoded from its streams and checked against the piece's size and change count (a
    dense piece's stream count, one per byte plane, is checked by `decode_piece`)."""
    if encoding in DENSE_ENCODINGS:
        return None
    expected = 4 if encoding == "sparse_add" else 3
    if len(raw) != expected:
        raise CorruptDeltaError(f"{encoding} piece has {len(raw)} streams, expected {expected}")
    positions = decode_positions(raw[0], raw[1], size)
    if positions.size != num_changed:
        raise CorruptDeltaError("decoded change count differs from the piece header")
    return positions


def decode_piece(
    encoding: Encoding,
    raw: list[np.ndarray],
    target: ElementRange,
    num_changed: int,
    positions: np.ndarray | None = None,
) -> Written:
    """What one piece writes into `target` (which holds the base), computed without writing.
    `positions`: the piece's `piece_positions`, when the caller decoded them already."""
    if positions is None:
        positions = piece_positions(encoding, raw, target.size, num_changed)
    if encoding in DENSE_ENCODINGS:
        if encoding == "dense_add":
            codes = unpack_codes(raw, target.size, target.width)
            return Written(None, target.read_all() + unzigzag(codes))
        values = from_plane_streams(raw, target.width, target.size)
        if encoding == "raw":
            return Written(None, values)
        if encoding == "dense_xor":
            return Written(None, values ^ target.read_all())
        return Written(None, target.read_all() + unzigzag(values))
    assert positions is not None
    old = target.gather(positions)
    if encoding == "sparse_add":
        return Written(positions, decode_add_values(old, raw[2], raw[3]))
    flips = from_planes(raw[2], target.width)
    if flips.size != positions.size:
        raise CorruptDeltaError("value stream size does not match the change count")
    return Written(positions, old ^ flips)


def written_by(
    new: np.ndarray, piece: EncodedPiece, positions: np.ndarray, new_vals: np.ndarray
) -> Written:
    """What decoding `piece` will write, computed on the encoder side for the output hash."""
    if piece.encoding in DENSE_ENCODINGS:
        return Written(None, new)
    return Written(positions, new_vals)


def hash_written(hasher: Any, name: str, start: int, written: Written) -> None:
    """Feed what a piece writes into the chunk's output hash.

    In order: msgpack [name, start, number of elements written], the int64 LE positions
    relative to start (sparse encodings only), then the bytes written.
    """
    hasher.update(msgspec.msgpack.encode([name, start, int(written.values.size)]))
    if written.positions is not None:
        hasher.update(np.ascontiguousarray(written.positions, dtype="<i8"))
    hasher.update(np.ascontiguousarray(written.values))
