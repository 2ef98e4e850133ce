"""Fetch and decode overlapped per chunk on a real nats-server (libs/weights/pipelined.py):
the same bytes as fetching everything first, and a corrupt chunk still writes nothing."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.weights import CorruptDeltaError, DeltaApplier, EncodeOptions, VersionInfo, encode
from libs.weights.format import Chunk, ChunkRef
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.hashing import digest
from libs.weights.pipelined import fetch_and_prepare
from libs.weights.tensors import RawTensor
from libs.weights.transport import store_chunks

SMALL = EncodeOptions(max_chunk_bytes=16 << 10)


def bf16_step(seed: int, numel: int = 150_000) -> tuple[dict, dict]:
    """A base of bf16 values (NaN payloads and -0.0 among them) and a step moving some of
    them by one unit in the last place, others to a special pattern."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, numel, dtype=np.uint16)
    new = old.copy()
    picked = rng.random(numel) < 0.3
    new[picked] += np.uint16(1)
    new[:3] = [0x8000, 0x7FC1, 0xFFC7]  # -0.0 and two NaN payloads
    as_raw = lambda units: {"w": RawTensor("BF16", (numel,), units.view(np.uint8))}  # noqa: E731
    return as_raw(old), as_raw(new)


@pytest.fixture
async def chunk_bus(bus: Bus) -> Bus:
    await provision(bus.js)
    return bus


def torch_state(raw: dict[str, RawTensor]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(t.data.copy()).view(torch.bfloat16) for n, t in raw.items()}


async def test_overlapped_receive_applies_the_same_bytes_as_fetch_then_decode(
    chunk_bus: Bus,
) -> None:
    base, new = bf16_step(1)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=SMALL)
    assert len(chunks) >= 4, "the test needs several chunks"
    await store_chunks(Publisher(chunk_bus.js), manifest, chunks)
    for applier_type in (DeltaApplier, DeviceDeltaApplier):
        state = torch_state(base)
        current = VersionInfo(version=1, hash=manifest.base_hash or "")
        applier = applier_type(state, manifest, current)
        receipt = await fetch_and_prepare(chunk_bus.nc, manifest, applier, threads=4, parallel=2)
        assert [p.index for p in receipt.prepared] == [ref.index for ref in manifest.chunks]
        applier.commit_all(receipt.prepared, threads=2)
        held = applier.finish(verify_full=True)
        assert held == VersionInfo(version=2, hash=manifest.target_hash)
        assert state["w"].view(torch.int16).numpy().tobytes() == new["w"].data.tobytes()


async def test_a_chunk_that_decodes_wrong_is_refused_and_nothing_is_written(
    chunk_bus: Bus,
) -> None:
    base, new = bf16_step(2)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=SMALL)
    # A chunk whose payload and hashes agree with the manifest, but whose bytes decode to
    # other values than its output hash says (a bug or a wrong base, not bus damage).
    victim = chunks[1]
    payload = bytearray(victim.payload)
    payload[-1] ^= 0x01
    header = msgspec.structs.replace(victim.header, payload_hash=digest(bytes(payload)).hex())
    forged = Chunk(header=header, payload=bytes(payload))
    refs = list(manifest.chunks)
    refs[1] = ChunkRef(
        index=1,
        num_bytes=len(msgspec.msgpack.encode(forged)),
        payload_hash=header.payload_hash,
        tensors=refs[1].tensors,
    )
    manifest = msgspec.structs.replace(manifest, chunks=refs)
    chunks = [chunks[0], forged, *chunks[2:]]
    await store_chunks(Publisher(chunk_bus.js), manifest, chunks)
    state = torch_state(base)
    applier = DeltaApplier(state, manifest, VersionInfo(version=1, hash=manifest.base_hash or ""))
    with pytest.raises(CorruptDeltaError, match=r"chunk 1|decompress"):
        await fetch_and_prepare(chunk_bus.nc, manifest, applier, threads=3)
    assert state["w"].view(torch.int16).numpy().tobytes() == base["w"].data.tobytes()
