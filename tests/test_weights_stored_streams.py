"""Streams stored uncompressed where zstd does not pay (format 4): exact, smaller-or-equal,
and refused when damaged (libs/weights/encodings.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from libs.weights import (
    CorruptDeltaError,
    DeltaApplier,
    EncodeOptions,
    RawTensor,
    VersionInfo,
    decode,
    encode,
    encode_snapshot,
)
from libs.weights.encodings import (
    SAMPLE_BYTES,
    STORED_UNLESS_SAVES,
    decompress,
    is_stored,
    pack_stream,
)
from libs.weights.format import FORMAT_VERSION, Chunk, ChunkHeader, PieceHeader
from libs.weights.hashing import digest, state_hash

OPTIONS = EncodeOptions(max_chunk_bytes=1 << 20)


def noise_bf16(rng: np.random.Generator, numel: int) -> RawTensor:
    """bf16 bit patterns with a random mantissa byte (incompressible) and every special value:
    NaN payloads, -0.0, +-inf, subnormals."""
    units = rng.integers(0, 1 << 16, numel, dtype=np.uint16)
    specials = np.array([0x7FC1, 0x7F81, 0xFFC3, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001], "<u2")
    units[: specials.size] = specials
    return RawTensor("BF16", (numel,), units.view(np.uint8))


def stored_counts(chunks: list[Chunk]) -> tuple[int, int]:
    """(stored streams, all non-empty streams) over the chunks."""
    pairs = [
        (size, raw)
        for chunk in chunks
        for piece in chunk.header.pieces
        for size, raw in zip(piece.stream_sizes, piece.raw_sizes, strict=True)
        if raw
    ]
    return sum(is_stored(size, raw) for size, raw in pairs), len(pairs)


def test_a_noise_stream_is_stored_and_a_redundant_one_compressed() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 4 * SAMPLE_BYTES, dtype=np.uint8)
    zeros = np.zeros(4 * SAMPLE_BYTES, dtype=np.uint8)
    small_noise = rng.integers(0, 256, 1000, dtype=np.uint8)
    for data in (noise, small_noise):
        packed = pack_stream(data, 1)
        assert is_stored(len(packed), data.size)
        assert bytes(packed) == data.tobytes()
        assert np.array_equal(decompress(packed, data.size), data)
    packed = pack_stream(zeros, 1)
    assert len(packed) <= zeros.size * (1 - STORED_UNLESS_SAVES)
    assert np.array_equal(decompress(packed, zeros.size), zeros)


def test_a_snapshot_of_noise_weights_stores_its_mantissa_plane_and_round_trips_exactly() -> None:
    rng = np.random.default_rng(1)
    state = {"w": noise_bf16(rng, 300_000), "b": noise_bf16(rng, 1_000)}
    manifest, chunks = encode_snapshot(state, version=3, options=OPTIONS)
    stored, total = stored_counts(chunks)
    assert stored and stored <= total
    out = decode({}, manifest, chunks, kind="raw", verify_full=True)
    for name, tensor in state.items():
        assert out[name].data.tobytes() == tensor.data.tobytes(), name


def test_a_dense_step_of_special_values_round_trips_bit_exactly_with_stored_planes() -> None:
    rng = np.random.default_rng(2)
    base = {"w": noise_bf16(rng, 200_000)}
    new_units = rng.integers(0, 1 << 16, 200_000, dtype=np.uint16)  # every element changes
    new_units[:4] = [0x8000, 0x0000, 0x7FC2, 0xFFFF]  # -0.0, +0.0, two NaN payloads
    new = {"w": RawTensor("BF16", (200_000,), new_units.view(np.uint8))}
    manifest, chunks = encode(base, new, base_version=1, version=2, options=OPTIONS)
    assert stored_counts(chunks)[0] > 0
    encodings = {p.encoding for c in chunks for p in c.header.pieces}
    assert encodings <= {"dense_add", "raw", "dense_xor"}
    out = decode(base, manifest, chunks, kind="raw", verify_full=True)
    assert out["w"].data.tobytes() == new["w"].data.tobytes()


def test_a_damaged_stored_stream_is_refused_before_anything_is_written() -> None:
    rng = np.random.default_rng(3)
    base = {"w": noise_bf16(rng, 100_000)}
    new = {"w": noise_bf16(np.random.default_rng(4), 100_000)}
    manifest, chunks = encode(base, new, base_version=1, version=2, options=OPTIONS)
    chunk = next(c for c in chunks if stored_counts([c])[0])
    payload = bytearray(chunk.payload)
    payload[-5] ^= 0x01  # a flip inside the last (stored) stream
    forged = ChunkHeader(  # even with a payload hash that matches, the output hash refuses it
        **{**msgspec.structs.asdict(chunk.header), "payload_hash": digest(bytes(payload)).hex()}
    )
    state = {"w": RawTensor("BF16", (100_000,), base["w"].data.copy())}
    applier = DeltaApplier(state, manifest, VersionInfo(version=1, hash=manifest.base_hash or ""))
    with pytest.raises(CorruptDeltaError, match="payload"):
        applier.apply(Chunk(header=chunk.header, payload=bytes(payload)))
    with pytest.raises(CorruptDeltaError):
        applier.apply(Chunk(header=forged, payload=bytes(payload)), check_payload=False)
    assert state["w"].data.tobytes() == base["w"].data.tobytes()


def test_a_stream_that_claims_a_wrong_raw_size_is_refused() -> None:
    rng = np.random.default_rng(5)
    state = {"w": noise_bf16(rng, 50_000)}
    manifest, chunks = encode_snapshot(state, version=1, options=OPTIONS)
    header = chunks[0].header
    piece = header.pieces[0]
    bad_piece = PieceHeader(
        **{**msgspec.structs.asdict(piece), "raw_sizes": [s + 1 for s in piece.raw_sizes]}
    )
    bad = Chunk(
        header=ChunkHeader(**{**msgspec.structs.asdict(header), "pieces": [bad_piece]}),
        payload=chunks[0].payload,
    )
    applier = DeltaApplier({}, manifest)
    with pytest.raises(CorruptDeltaError):
        applier.apply(bad)


def test_a_manifest_of_the_format_before_stored_streams_is_refused_by_name() -> None:
    rng = np.random.default_rng(6)
    state = {"w": noise_bf16(rng, 1_000)}
    manifest, _ = encode_snapshot(state, version=1)
    old = msgspec.structs.replace(manifest, format_version=FORMAT_VERSION - 1)
    with pytest.raises(CorruptDeltaError, match=f"reads format {FORMAT_VERSION}"):
        DeltaApplier({}, old)
    assert state_hash(state) == manifest.target_hash
