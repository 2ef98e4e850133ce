"""The GPU path of the delta codec (libs/weights/gpu.py and gpu_apply.py): diff and apply.

Every test runs on CPU torch tensors through the same code; the `cuda` cases skip without a
GPU. The reference is always the CPU codec: the device encoder must produce the same bytes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from libs.weights import (
    CorruptDeltaError,
    DeltaApplier,
    EncodeOptions,
    VersionInfo,
    encode,
    gpu,
    gpu_apply,
)
from libs.weights.encoder import EncodeTimes
from libs.weights.encodings import pack_codes, plane_streams, unzigzag
from libs.weights.format import Chunk, encode_chunk, encode_manifest
from libs.weights.gpu import device_changes, encode_device, on_device
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.hashing import state_hash
from libs.weights.scan import changed_elements
from libs.weights.tensors import DTYPE_WIDTHS, _torch_dtypes, as_raw, raw_state

SMALL = EncodeOptions(max_chunk_bytes=16 << 10)  # many chunks and pieces on small tensors
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = ["BF16", "F16", "F32", "I8", "BOOL", "F64", "U8", "F8_E4M3"]

# f32 bit patterns a float compare would get wrong: +-0, +-inf, NaNs with payloads, subnormals.
SPECIAL_F32 = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC12345,
               0x7F800001, 0x00000001, 0x807FFFFF]  # fmt: skip


def bits_tensor(bits: np.ndarray, dtype: str, device: str) -> torch.Tensor:
    """A torch tensor of `dtype` holding exactly these little-endian bytes."""
    data = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).copy())
    return data.view(_torch_dtypes()[dtype]).to(device)


def random_pair(
    rng: np.random.Generator, dtype: str, numel: int, fraction: float, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary bit patterns and a copy with about `fraction` of the elements re-drawn."""
    width = DTYPE_WIDTHS[dtype]
    top = 2 if dtype == "BOOL" else 256
    old = rng.integers(0, top, numel * width, dtype=np.uint8)
    fresh = rng.integers(0, top, numel * width, dtype=np.uint8)
    units_old, units_new = old.view(f"<u{width}"), fresh.view(f"<u{width}").copy()
    keep = rng.random(numel) >= fraction
    units_new[keep] = units_old[keep]
    return bits_tensor(units_old, dtype, device), bits_tensor(units_new, dtype, device)


def special_pair(dtype: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN payloads, signed zeros, infinities and subnormals, rotated by one element."""
    width = DTYPE_WIDTHS[dtype]
    base = np.array(SPECIAL_F32, dtype=np.uint64)
    patterns = base << np.uint64(32) if width == 8 else base >> np.uint64(32 - 8 * width)
    old = patterns.astype(f"<u{width}")
    return bits_tensor(old, dtype, device), bits_tensor(np.roll(old, 1), dtype, device)


def host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cpu().clone() for name, tensor in state.items()}


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert np.array_equal(as_raw(got[name].cpu()).data, as_raw(tensor.cpu()).data), name


def assert_same_delta(a: tuple, b: tuple) -> None:
    """Same manifest and chunks, byte for byte."""
    assert encode_manifest(a[0]) == encode_manifest(b[0])
    assert [encode_chunk(c) for c in a[1]] == [encode_chunk(c) for c in b[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_changes_equal_the_cpu_scan(device: str, dtype: str) -> None:
    rng = np.random.default_rng(DTYPES.index(dtype))
    old, new = random_pair(rng, dtype, 50_000, 0.03, device)
    got = device_changes(old, new)
    width = DTYPE_WIDTHS[dtype]
    want = changed_elements(as_raw(old.cpu()).data, as_raw(new.cpu()).data, width)
    assert got.positions.size > 0
    assert np.array_equal(got.positions, want.positions)
    assert got.old.dtype == want.old.dtype and np.array_equal(got.old, want.old)
    assert np.array_equal(got.new, want.new)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "F64"])
def test_nan_payloads_and_signed_zeros_are_changes_and_survive(device: str, dtype: str) -> None:
    old, new = special_pair(dtype, device)
    assert device_changes(old, new).positions.size == old.numel()  # no float compare
    base, target = {"w": old}, {"w": new}
    mirror = host(base)
    got = encode_device(base, target, mirror, base_version=1, version=2, options=SMALL)
    assert_same_delta(
        got, encode(host(base), host(target), base_version=1, version=2, options=SMALL)
    )
    state = {"w": old.clone()}
    applier = DeviceDeltaApplier(state, got[0])
    for chunk in got[1]:
        applier.apply(chunk)
    applier.finish(verify_full=True)
    assert_same_bits(state, target)
    assert_same_bits(mirror, target)


def mixed_states(device: str, seed: int = 0) -> tuple[dict, dict]:
    """Sparse and dense changes in every dtype, identical, added, reshaped, removed tensors."""
    rng = np.random.default_rng(seed)
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        fraction = [0.0, 0.02, 0.5, 1.0][i % 4]
        base[f"t{i}.{dtype}"], new[f"t{i}.{dtype}"] = random_pair(
            rng, dtype, 3_000 + 997 * i, fraction, device
        )
    master = torch.randn(20_000, generator=torch.Generator().manual_seed(seed)) * 0.02
    base["step"] = master.to(torch.bfloat16).to(device)  # small moves: sparse_add wins
    new["step"] = (master + master.sign() * 3e-6).to(torch.bfloat16).to(device)
    base["reshaped"], _ = random_pair(rng, "BF16", 600, 0.0, device)
    new["reshaped"] = base["reshaped"].reshape(20, 30).clone()
    base["retyped"], _ = random_pair(rng, "F32", 100, 0.0, device)
    new["retyped"] = base["retyped"].to(torch.float16)
    base["removed"], _ = random_pair(rng, "I8", 10, 0.0, device)
    new["added"], _ = random_pair(rng, "F16", 4096, 0.0, device)
    return base, new


@pytest.mark.parametrize("device", DEVICES)
def test_device_encoder_is_byte_identical_to_the_cpu_encoder(device: str) -> None:
    base, new = mixed_states(device)
    mirror = host(base)
    host_times, device_times = EncodeTimes(), EncodeTimes()
    started = time.perf_counter()
    want = encode(host(base), host(new), base_version=4, version=5, options=SMALL, times=host_times)
    host_s = time.perf_counter() - started
    got = encode_device(
        base, new, mirror, base_version=4, version=5, options=SMALL, times=device_times
    )
    device_s = time.perf_counter() - started - host_s
    assert_same_delta(got, want)
    assert 0 < host_times.diff_s < host_s and 0 < device_times.diff_s < device_s
    encodings = {p.encoding for c in got[1] for p in c.header.pieces}
    assert {"sparse_add", "raw"} <= encodings and encodings & {"sparse_xor", "dense_xor"}
    assert_same_bits(mirror, new)  # the mirror now holds the target: the next call's base
    assert state_hash(raw_state(mirror)) == got[0].target_hash


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spared", [("dense",), ("dense", "sparse")])
def test_tensors_cross_into_spare_buffers_that_swap_with_the_mirror(
    device: str, spared: tuple[str, ...]
) -> None:
    """A tensor with a spare host buffer is copied into it whole (the trainer keeps one per
    tensor, pinned); one without is patched with its changes (a dense one copied fresh): the
    delta is the CPU encoder's either way."""
    rng = np.random.default_rng(7)
    versions = [{"dense": random_pair(rng, "BF16", 8192, 0.0, device)[0],
                 "sparse": random_pair(rng, "F32", 4096, 0.0, device)[0]}]  # fmt: skip
    for _ in range(3):  # each version re-draws half of "dense" and 1% of "sparse"
        previous = versions[-1]
        versions.append({
            "dense": random_pair(rng, "BF16", 8192, 0.5, device)[1].where(
                torch.from_numpy(rng.random(8192) < 0.5).to(device), previous["dense"]),
            "sparse": previous["sparse"].where(
                torch.from_numpy(rng.random(4096) >= 0.01).to(device),
                random_pair(rng, "F32", 4096, 0.0, device)[0]),
        })  # fmt: skip
    mirror = host(versions[0])
    spare = {name: torch.empty_like(mirror[name]) for name in spared}
    buffers = {name: {spare[name].data_ptr(), mirror[name].data_ptr()} for name in spared}
    patched = None if "sparse" in spared else mirror["sparse"].data_ptr()
    for v in range(1, 4):
        base, new = versions[v - 1], versions[v]
        want = encode(host(base), host(new), base_version=v - 1, version=v, options=SMALL)
        got = encode_device(
            base, new, mirror, base_version=v - 1, version=v, options=SMALL, spare=spare
        )
        assert_same_delta(got, want)
        assert {p.encoding for c in got[1] for p in c.header.pieces if p.name == "dense"} == {
            "dense_add"
        }
        assert_same_bits(mirror, new)
        # The two host buffers of a spared tensor take turns: no fresh allocation.
        for name in spared:
            assert {spare[name].data_ptr(), mirror[name].data_ptr()} == buffers[name]
            assert_same_bits({name: spare[name]}, {name: base[name]})
        if patched is not None:
            assert mirror["sparse"].data_ptr() == patched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_device_elements", [0, gpu_apply.DEVICE_DECODE_MIN_ELEMENTS])
def test_device_apply_writes_in_place_and_matches_the_target(
    device: str, min_device_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense pieces decoded on the device (every one, at 0) or, when small, on the host."""
    monkeypatch.setattr(gpu_apply, "DEVICE_DECODE_MIN_ELEMENTS", min_device_elements)
    base, new = mixed_states(device, seed=1)
    manifest, chunks = encode(host(base), host(new), base_version=4, version=5, options=SMALL)
    state = {name: tensor.clone() for name, tensor in base.items()}
    pointers = {name: tensor.data_ptr() for name, tensor in state.items()}
    applier = DeviceDeltaApplier(state, manifest, reuse_whole=True)
    prepared = [applier.prepare(chunk) for chunk in reversed(chunks)]
    assert_same_bits({n: state[n] for n in base}, base)  # prepare reads only
    for chunk in prepared:
        applier.commit(chunk)
    held = applier.finish(verify_full=True)
    assert held == VersionInfo(version=5, hash=manifest.target_hash)
    assert_same_bits(state, new)
    for name in ("t1.F16", "t2.F32", "t3.I8"):  # patched where it lives, not replaced
        assert state[name].data_ptr() == pointers[name]
    assert all(t.device.type == torch.device(device).type for t in state.values())
    cpu_applier = DeltaApplier(host(base), manifest, reuse_whole=True)
    cpu_written = sum(cpu_applier.prepare(chunk).num_written for chunk in chunks)
    assert sum(p.num_written for p in prepared) == cpu_written  # the same elements, no more


@pytest.mark.parametrize("device", DEVICES)
def test_device_apply_refuses_a_corrupt_chunk_without_writing(device: str) -> None:
    base, new = mixed_states(device, seed=2)
    manifest, chunks = encode(host(base), host(new), base_version=1, version=2, options=SMALL)
    state = {name: tensor.clone() for name, tensor in base.items()}
    applier = DeviceDeltaApplier(state, manifest)
    payload = bytearray(chunks[0].payload)
    payload[len(payload) // 2] ^= 0x40
    with pytest.raises(CorruptDeltaError, match="payload"):
        applier.apply(Chunk(header=chunks[0].header, payload=bytes(payload)))
    assert_same_bits(state, base)


def test_the_receiver_keeps_the_cpu_applier_for_cpu_states() -> None:
    receiver = pytest.importorskip("libs.weights.receiver")  # needs the service dependencies
    cpu_state = {"w": torch.zeros(4)}
    assert not on_device(cpu_state)
    assert receiver._applier_type(cpu_state) is DeltaApplier


@CUDA
def test_the_receiver_picks_the_device_applier_for_cuda_states() -> None:
    receiver = pytest.importorskip("libs.weights.receiver")
    state = {"w": torch.zeros(4, device="cuda")}
    assert on_device(state)
    assert receiver._applier_type(state) is DeviceDeltaApplier


@CUDA
def test_only_the_changes_cross_to_the_host() -> None:
    """A bf16 step with ~3% of values changed transfers about 8 bytes per change."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(1 << 22, device="cuda", generator=gen) * 0.02
    old = master.to(torch.bfloat16)
    new = (master + torch.randn(1 << 22, device="cuda", generator=gen).sign() * 3e-6).to(
        torch.bfloat16
    )
    found = device_changes(old, new)
    crossed = found.positions.nbytes + found.old.nbytes + found.new.nbytes
    assert crossed == 8 * found.positions.size
    assert crossed < 0.5 * old.numel() * old.element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_of_many_tensors_is_diffed_with_one_copy_to_the_host(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each wait on the device costs as much as a small delta's whole diff on a GPU the
    # trainer keeps busy: the number of copies must not grow with the number of tensors.
    rng = np.random.default_rng(11)
    pairs = [random_pair(rng, "BF16", 2_000 + 37 * i, 0.02, device) for i in range(40)]
    pairs += [random_pair(rng, "F32", 1_000, 0.02, device) for _ in range(5)]  # another width
    base = {f"w{i}": old for i, (old, _) in enumerate(pairs)}
    new = {f"w{i}": fresh for i, (_, fresh) in enumerate(pairs)}
    copies = []
    to_host = gpu.host_bytes
    monkeypatch.setattr(gpu, "host_bytes", lambda parts: copies.append(1) or to_host(parts))
    found = gpu.device_diff(base, new, list(new))
    assert len(copies) == 1
    for name in new:
        want = changed_elements(
            as_raw(base[name].cpu()).data, as_raw(new[name].cpu()).data, DTYPE_WIDTHS[
                "F32" if new[name].dtype == torch.float32 else "BF16"]
        )  # fmt: skip
        assert np.array_equal(found[name].positions, want.positions), name
        assert np.array_equal(found[name].old, want.old) and np.array_equal(
            found[name].new, want.new
        )


@pytest.mark.parametrize("device", DEVICES)
def test_a_chunk_of_many_pieces_crosses_in_one_copy_each_way_per_step(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_apply, "DEVICE_DECODE_MIN_ELEMENTS", 0)  # its dense pieces are small
    base, new = mixed_states(device, seed=3)
    manifest, chunks = encode(host(base), host(new), base_version=1, version=2)
    assert len(chunks) == 1 and len(chunks[0].header.pieces) >= 10  # one chunk, many pieces
    uploads, downloads = [], []
    upload, download = gpu_apply.upload, gpu_apply._download
    monkeypatch.setattr(gpu_apply, "upload", lambda a, d: uploads.append(len(a)) or upload(a, d))
    monkeypatch.setattr(gpu_apply, "_download", lambda t: downloads.append(len(t)) or download(t))
    state = {name: tensor.clone() for name, tensor in base.items()}
    applier = DeviceDeltaApplier(state, manifest, reuse_whole=True)
    prepared = applier.prepare(chunks[0])
    # positions (and the planes of dense pieces decoded there) up, old values (and those
    # pieces' new ones) down, the other new values up: once each for the whole chunk
    assert len(uploads) == 2 and len(downloads) == 1
    width = {name: tensor.element_size() for name, tensor in new.items()}
    pieces = chunks[0].header.pieces
    there = [
        p
        for p in pieces
        if gpu_apply.decoded_on_device(p.encoding, width[p.name], p.stop - p.start)
    ]
    assert there, "the test needs a dense piece decoded on the device"
    assert uploads[1] == len(pieces) - len(there)
    applier.commit(prepared)
    applier.finish(verify_full=True)
    assert_same_bits(state, new)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("encoding", ["dense_add", "dense_xor"])
def test_dense_pieces_decoded_on_the_device_wrap_exactly_as_the_host_decode(
    device: str, width: int, encoding: str
) -> None:
    rng = np.random.default_rng(width)
    kind = {2: np.uint16, 4: np.uint32}[width]
    # every 16-bit pattern (NaN payloads, -0.0, inf, subnormals) or f32 specials, and codes
    # up to the full range, so additions wrap around 2^bits both ways
    old = np.arange(1 << 16, dtype=kind) if width == 2 else rng.integers(0, 1 << 32, 1 << 16)
    old = np.asarray(old, dtype=kind)
    if width == 4:
        old[: len(SPECIAL_F32)] = SPECIAL_F32
    values = rng.integers(0, 1 << (8 * width), old.size, dtype=np.uint64).astype(kind)
    top = (1 << (8 * width)) - 1
    values[:8] = [0, 1, 2, 3, top, top - 1, 4, 5]
    want = old + unzigzag(values) if encoding == "dense_add" else old ^ values
    if encoding == "dense_add":
        packed, escapes = pack_codes(values)
        streams = [packed, *plane_streams(escapes)]
    else:
        streams = plane_streams(values)
    gpu_apply.checked_streams(encoding, streams, old.size, width)
    on_device = [torch.from_numpy(p.copy()).to(device) for p in streams]
    old_bits = torch.from_numpy(old.view(f"<i{width}").copy()).to(device)
    got = gpu_apply.dense_on_device(encoding, on_device, old_bits)
    assert got.dtype == old_bits.dtype
    assert np.array_equal(got.cpu().numpy().view(kind), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_device_elements", [0, gpu.DEVICE_CODES_MIN_ELEMENTS])
def test_dense_codes_packed_on_the_device_encode_byte_identical_to_the_host(
    device: str, min_device_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense tensors coded on the device (every one, at 0) or, when small, on the host."""
    monkeypatch.setattr(gpu, "DEVICE_CODES_MIN_ELEMENTS", min_device_elements)
    gen = torch.Generator().manual_seed(7)
    master = torch.randn(70_000, generator=gen) * 0.02
    master[:4] = torch.tensor([0.0, -0.0, float("nan"), float("-inf")])
    base, new = {}, {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        moved = master + torch.randn(70_000, generator=gen) * 1e-3  # most elements change
        base[str(dtype)] = master.to(dtype).to(device)
        new[str(dtype)] = moved.to(dtype).to(device)
    new[str(torch.float32)][5] = float("nan")  # a NaN payload among the dense changes
    want = encode(host(base), host(new), base_version=1, version=2, options=SMALL)
    got = encode_device(base, new, host(base), base_version=1, version=2, options=SMALL)
    assert_same_delta(got, want)
    assert {p.encoding for c in got[1] for p in c.header.pieces} == {"dense_add"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_elements", [1 << 28, 100_000, 1])
def test_dense_codes_batched_across_tensors_encode_byte_identical_to_the_host(
    device: str, batch_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors of several widths and odd sizes coded together in one batch, in batches that
    cut between them, and one by one give the same delta as the host encoder."""
    monkeypatch.setattr(gpu, "CODES_BATCH_ELEMENTS", batch_elements)
    monkeypatch.setattr(gpu, "DEVICE_CODES_MIN_ELEMENTS", 0)  # every tensor coded there
    gen = torch.Generator().manual_seed(11)
    base, new = {}, {}
    for i, (dtype, size) in enumerate(
        [(torch.bfloat16, 70_001), (torch.float32, 4_099), (torch.float16, 60_002)]
    ):
        master = torch.randn(size, generator=gen) * 0.02
        moved = master + torch.randn(size, generator=gen) * 1e-3
        moved[::97] += 1.0  # escapes: codes of 3 and more
        base[f"t{i}"] = master.to(dtype).to(device)
        new[f"t{i}"] = moved.to(dtype).to(device)
    want = encode(host(base), host(new), base_version=1, version=2, options=SMALL)
    got = encode_device(base, new, host(base), base_version=1, version=2, options=SMALL)
    assert_same_delta(got, want)
    assert {p.encoding for c in got[1] for p in c.header.pieces} == {"dense_add"}
