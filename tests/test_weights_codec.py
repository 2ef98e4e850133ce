"""The weight-delta codec: bit-exact round trips, refusals and chunking (libs/weights)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.weights import (
    BaseMismatchError,
    CorruptDeltaError,
    DeltaApplier,
    EncodeOptions,
    Manifest,
    MissingChunkError,
    RawTensor,
    VersionInfo,
    decode,
    encode,
    encode_snapshot,
    pack_delta,
    unpack_delta,
)
from libs.weights.chunking import TensorJob
from libs.weights.encoder import SPARSE_THREADS, encode_threads, encoded_size
from libs.weights.encodings import compress, decompress
from libs.weights.format import Chunk, encode_chunk
from libs.weights.scan import Changes
from libs.weights.tensors import DTYPE_WIDTHS

SMALL = EncodeOptions(max_chunk_bytes=16 << 10)  # forces many chunks on small tensors


def random_raw(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> RawTensor:
    """A tensor of arbitrary bit patterns (NaN payloads, -0.0, inf, subnormals all appear)."""
    numel = int(np.prod(shape, dtype=np.int64))
    data = rng.integers(0, 256, numel * DTYPE_WIDTHS[dtype], dtype=np.uint8)
    if dtype == "BOOL":
        data &= 1
    return RawTensor(dtype, shape, data)


def mutate(rng: np.random.Generator, tensor: RawTensor, fraction: float) -> RawTensor:
    """A copy with about `fraction` of the elements set to new random bit patterns."""
    units = tensor.units().copy()
    picked = rng.random(units.size) < fraction
    fresh = random_raw(rng, tensor.dtype, (units.size,)).units()
    units[picked] = fresh[picked]
    return RawTensor(tensor.dtype, tensor.shape, units.view(np.uint8))


def assert_same_bytes(got: dict, want: dict[str, RawTensor]) -> None:
    """Same names in order, dtypes, shapes and bytes."""
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert isinstance(got[name], RawTensor)
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), name
        assert np.array_equal(got[name].data, tensor.data), name


def roundtrip(
    base: dict, new: dict, options: EncodeOptions = SMALL
) -> tuple[Manifest, list[Chunk], dict]:
    manifest, chunks = encode(base, new, base_version=1, version=2, options=options)
    out = decode(base, manifest, chunks, kind="raw", verify_full=True)
    return manifest, chunks, out


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(sorted(DTYPE_WIDTHS)), shapes), min_size=1, max_size=4
    ),
    fraction=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_states_of_every_dtype_round_trip_bit_exactly(
    specs: list, fraction: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    base = {f"t{i}": random_raw(rng, dtype, shape) for i, (dtype, shape) in enumerate(specs)}
    new = {name: mutate(rng, tensor, fraction) for name, tensor in base.items()}
    manifest, _, out = roundtrip(base, new)
    assert_same_bytes(out, new)
    expected = sum(int((base[n].units() != new[n].units()).sum()) for n in new)
    assert sum(e.num_changed for e in manifest.tensors) == expected


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), numel=st.integers(3, 3000))
def test_structure_changes_travel_whole(seed: int, numel: int) -> None:
    rng = np.random.default_rng(seed)
    base = {
        "kept": random_raw(rng, "BF16", (numel,)),
        "removed": random_raw(rng, "F32", (7,)),
        "reshaped": random_raw(rng, "F16", (numel, 2)),
        "retyped": random_raw(rng, "F32", (numel,)),
    }
    new = {
        "added": random_raw(rng, "F8_E4M3", (numel,)),
        "reshaped": RawTensor("F16", (2, numel), base["reshaped"].data.copy()),
        "retyped": RawTensor("I32", (numel,), base["retyped"].data.copy()),
        "kept": mutate(rng, base["kept"], 0.05),
    }
    manifest, _, out = roundtrip(base, new)
    assert_same_bytes(out, new)
    changes = {e.name: e.change for e in manifest.tensors}
    assert changes["added"] == changes["reshaped"] == changes["retyped"] == "whole"
    assert manifest.removed == ["removed"]


SPECIAL_F32 = np.array(
    [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00001,
        0xFFC12345,
        0x7F800001,
        0x00000001,
        0x807FFFFF,
    ],
    dtype=np.uint32,
)


@pytest.mark.parametrize("dtype,bits", [("F32", 32), ("BF16", 16), ("F16", 16), ("F64", 64)])
def test_nan_payloads_signed_zeros_inf_and_subnormals_are_kept(dtype: str, bits: int) -> None:
    patterns = (
        (SPECIAL_F32.astype(np.uint64) << np.uint64(bits - 32))
        if bits == 64
        else SPECIAL_F32 >> (32 - bits)
    )
    old = np.asarray(patterns, dtype=f"<u{bits // 8}")
    new = np.roll(old, 1)  # +0.0 -> -0.0, NaN -> other NaN, ...: equal as floats, not as bytes
    base = {"w": RawTensor(dtype, (old.size,), old.view(np.uint8))}
    target = {"w": RawTensor(dtype, (new.size,), new.view(np.uint8))}
    manifest, _, out = roundtrip(base, target)
    assert manifest.tensors[0].num_changed == old.size
    assert_same_bytes(out, target)


def test_identical_tensors_cost_only_a_manifest_flag() -> None:
    rng = np.random.default_rng(0)
    base = {"a": random_raw(rng, "BF16", (4096,)), "b": random_raw(rng, "F32", (100,))}
    new = {"a": base["a"], "b": mutate(rng, base["b"], 0.5)}
    manifest, chunks, out = roundtrip(base, new)
    assert [e.change for e in manifest.tensors] == ["same", "delta"]
    assert all(p.name == "b" for c in chunks for p in c.header.pieces)
    assert_same_bytes(out, new)


def bf16_step(numel: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 weights before and after a tiny update (a few percent of values change)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen) * 0.02
    step = torch.randn(numel, generator=gen).sign() * 3e-6
    return {"w": master.to(torch.bfloat16)}, {"w": (master + step).to(torch.bfloat16)}


def test_sparse_bf16_update_compresses_well_and_round_trips_torch() -> None:
    base, new = bf16_step(400_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    out = decode(base, manifest, chunks)
    assert torch.equal(out["w"].view(torch.int16), new["w"].view(torch.int16))
    encoded = sum(len(encode_chunk(c)) for c in chunks)
    changed = manifest.tensors[0].num_changed
    assert 0.005 < changed / 400_000 < 0.2
    assert encoded * 8 < 10 * changed  # under 10 bits per change; index + value would be 48
    assert {p.encoding for c in chunks for p in c.header.pieces} == {"sparse_add"}


def dense_bf16_step(numel: int, lr: float = 5e-4) -> tuple[dict, dict]:
    """bf16 weights before and after an Adam-sized step at the demo's rate: nearly every
    element moves by several units in the last place."""
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(numel, generator=gen) * 0.02
    step = torch.randn(numel, generator=gen).sign() * lr
    return {"w": master.to(torch.bfloat16)}, {"w": (master + step).to(torch.bfloat16)}


def test_a_dense_bf16_step_travels_as_dense_add_smaller_than_raw_and_exact() -> None:
    base, new = dense_bf16_step(400_000)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=SMALL)
    assert {p.encoding for c in chunks for p in c.header.pieces} == {"dense_add"}
    out = decode(base, manifest, chunks)
    assert torch.equal(out["w"].view(torch.int16), new["w"].view(torch.int16))
    changed = int((base["w"].view(torch.int16) != new["w"].view(torch.int16)).sum())
    assert manifest.tensors[0].num_changed == changed > 0.9 * 400_000
    payload = sum(len(c.payload) for c in chunks)
    assert payload * 2 < 400_000 * 2  # under half the raw bf16 bytes


@pytest.mark.parametrize("dtype", sorted(DTYPE_WIDTHS))
def test_a_mostly_changed_tensor_of_any_dtype_round_trips_through_dense_add(dtype: str) -> None:
    rng = np.random.default_rng(DTYPE_WIDTHS[dtype])
    base = {"w": random_raw(rng, dtype, (5_000,)), "same": random_raw(rng, dtype, (300,))}
    units = base["w"].units().copy()
    units[:4_500] ^= 1  # 90% of the elements change (a bool stays a bool)
    changed = RawTensor(dtype, (5_000,), units.view(np.uint8))
    new = {"w": changed, "same": base["same"]}
    manifest, chunks, out = roundtrip(base, new)
    assert {p.encoding for c in chunks for p in c.header.pieces} == {"dense_add"}
    assert [e.change for e in manifest.tensors] == ["delta", "same"]
    assert_same_bytes(out, new)


def test_in_place_apply_touches_the_given_tensors_in_any_chunk_order() -> None:
    base, new = bf16_step(300_000)
    manifest, chunks = encode(
        base, new, base_version=5, version=6, options=EncodeOptions(max_chunk_bytes=16 << 10)
    )
    assert len(chunks) > 2
    state = {"w": base["w"].clone()}
    tensor = state["w"]
    applier = DeltaApplier(state, manifest, VersionInfo(version=5, hash=manifest.base_hash or ""))
    applier.apply_all(reversed(chunks), threads=2)
    info = applier.finish(verify_full=True)
    assert info.version == 6 and info.hash == manifest.target_hash
    assert state["w"] is tensor
    assert torch.equal(tensor.view(torch.int16), new["w"].view(torch.int16))


def test_chunks_stay_below_the_max_and_big_tensors_span_several() -> None:
    rng = np.random.default_rng(1)
    base = {
        "big": random_raw(rng, "F32", (200_000,)),
        **{f"s{i}": random_raw(rng, "U8", (50,)) for i in range(20)},
    }
    limit = 64 << 10
    manifest, chunks = encode_snapshot(
        base, version=1, options=EncodeOptions(max_chunk_bytes=limit)
    )
    assert all(len(encode_chunk(c)) <= limit for c in chunks)
    assert sum("big" in ref.tensors for ref in manifest.chunks) > 5
    assert any(len(ref.tensors) > 5 for ref in manifest.chunks)  # small tensors share a chunk
    assert_same_bytes(decode({}, manifest, chunks, kind="raw", verify_full=True), base)


def test_delta_against_another_base_is_refused() -> None:
    base, new = bf16_step(10_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    other = {"w": bf16_step(10_000, seed=9)[0]["w"]}
    with pytest.raises(BaseMismatchError, match="base hash"):
        decode(other, manifest, chunks)
    with pytest.raises(BaseMismatchError, match="receiver holds 7"):
        decode(
            base, manifest, chunks, current=VersionInfo(version=7, hash=manifest.base_hash or "")
        )


def test_corrupted_chunk_is_refused_and_writes_nothing() -> None:
    base, new = bf16_step(20_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    payload = bytearray(chunks[0].payload)
    payload[len(payload) // 2] ^= 0x40
    bad = Chunk(header=chunks[0].header, payload=bytes(payload))
    state = {"w": base["w"].clone()}
    applier = DeltaApplier(state, manifest)
    with pytest.raises(CorruptDeltaError, match="payload"):
        applier.apply(bad)
    assert torch.equal(state["w"].view(torch.int16), base["w"].view(torch.int16))


def test_missing_or_foreign_chunk_is_detected() -> None:
    base, new = bf16_step(100_000)
    options = EncodeOptions(max_chunk_bytes=16 << 10)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=options)
    with pytest.raises(MissingChunkError):
        decode(base, manifest, chunks[1:])
    _, other_chunks = encode(
        base, bf16_step(100_000, seed=3)[1], base_version=1, version=2, options=options
    )
    with pytest.raises(CorruptDeltaError, match="belongs to"):
        decode(base, manifest, [other_chunks[0], *chunks[1:]])


def test_manifest_and_chunks_survive_msgpack_and_the_file_container() -> None:
    base, new = bf16_step(5_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    blob = pack_delta(manifest, chunks)
    again, again_chunks = unpack_delta(blob)
    assert again == manifest and again_chunks == chunks
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(manifest), type=Manifest) == manifest
    for broken in (blob[:-3], blob + b"x", b"XXXXXXXX" + blob[8:], blob[:20] + b"\0" + blob[21:]):
        with pytest.raises(CorruptDeltaError):
            unpack_delta(broken)


def test_numpy_states_round_trip_as_numpy() -> None:
    rng = np.random.default_rng(2)
    base = {
        "x": rng.standard_normal((30, 7)).astype(np.float32),
        "i": np.arange(10, dtype=np.int64),
    }
    new = {"x": base["x"].copy(), "i": base["i"] + 1}
    new["x"][3, 2] = -0.0
    manifest, chunks = encode(base, new, base_version=0, version=1)
    out = decode(base, manifest, chunks)
    assert isinstance(out["x"], np.ndarray)
    assert out["x"].tobytes() == new["x"].tobytes() and out["i"].tobytes() == new["i"].tobytes()


def test_each_thread_compresses_with_its_own_kept_context_to_the_bytes_of_a_fresh_one() -> None:
    rng = np.random.default_rng(5)
    buffers = [rng.integers(0, 1 + 7 * i, size=1_000 * (i + 1), dtype=np.uint8) for i in range(6)]
    jobs = [(buffer, level) for level in (1, 3) for buffer in buffers]
    fresh = [zstandard.ZstdCompressor(level=level).compress(b.data) for b, level in jobs]

    def compress_all(_: int) -> list[bytes]:  # each thread, three times over
        return [compress(buffer, level) for _ in range(3) for buffer, level in jobs]

    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(compress_all, range(8)))
    assert all(out == fresh * 3 for out in outputs)
    for (buffer, _), stream in zip(jobs, fresh, strict=True):
        assert np.array_equal(decompress(stream, buffer.size), buffer)
    with pytest.raises(CorruptDeltaError, match="does not decompress"):
        decompress(fresh[1][:-3], buffers[1].size)
    assert np.array_equal(decompress(fresh[1], buffers[1].size), buffers[1])  # still usable


@pytest.mark.parametrize("payload_bytes", [0, 1, 255, 256, 65_535, 65_536, 1 << 20])
def test_a_chunks_encoded_size_is_counted_without_encoding_its_payload(payload_bytes: int) -> None:
    manifest, chunks = encode_snapshot({"w": np.zeros(4, np.float32)}, version=1)
    chunk = Chunk(header=chunks[0].header, payload=b"\x07" * payload_bytes)
    assert encoded_size(chunk) == len(encode_chunk(chunk))
    assert manifest.chunks[0].num_bytes == len(encode_chunk(chunks[0]))


def test_a_version_of_mostly_sparse_pieces_is_encoded_on_fewer_threads() -> None:
    """Sparse pieces hold the GIL between short numpy calls: past SPARSE_THREADS more threads
    only wait; dense pieces (zstd) take every thread offered."""
    changes = Changes(np.arange(1_000), np.zeros(1_000, np.uint16), np.ones(1_000, np.uint16))
    sparse = TensorJob("sparse", 2, 1 << 20, changes)
    small_dense = TensorJob("bias", 2, 896, None, dense=True)
    big_dense = TensorJob("mlp", 2, 1 << 26, None, dense=True)
    assert encode_threads([sparse, small_dense], 16) == SPARSE_THREADS
    assert encode_threads([sparse, small_dense], 4) == 4
    assert encode_threads([sparse, big_dense], 16) == 16
    assert encode_threads([big_dense], 16) == 16
