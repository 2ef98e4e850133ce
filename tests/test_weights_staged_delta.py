"""A delta the trainer encodes reaches the broadcaster through shared memory where they share
one, through the staging disk elsewhere, and is read without copying a chunk; the codec's
fast paths (symbol counts, chunk prefixes, chunks sized for many cores) change no byte."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from libs.weights import handoff
from libs.weights.applier import decode
from libs.weights.container import map_delta_file, write_delta_file
from libs.weights.encoder import EncodeOptions, encode
from libs.weights.encodings import nonzero_symbols
from libs.weights.errors import CorruptDeltaError
from libs.weights.format import Chunk, ChunkHeader, chunk_prefix, encode_chunk
from libs.weights.handoff import (
    SHM_OFFER,
    load_staged_delta,
    remove_staged_before,
    write_staged_delta,
)
from proto.messages import WeightsStaged


def step(numel: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 weights before and after a small update (a few percent of values change)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen) * 0.02
    moved = master + torch.randn(numel, generator=gen).sign() * 3e-6
    return {"w": master.to(torch.bfloat16)}, {"w": moved.to(torch.bfloat16)}


def staged_message(path: Path, version: int, base_version: int) -> WeightsStaged:
    return WeightsStaged(
        version=version, file_name=path.name, num_bytes=path.stat().st_size, created_at=0.0,
        kind="delta", base_version=base_version,
    )  # fmt: skip


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm (the same code, its own folder)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(handoff, "SHM_PATH", folder)
    return folder


def test_a_staged_delta_goes_through_shared_memory_once_offered_and_leaves_with_its_name(
    tmp_path: Path, shm: Path
) -> None:
    staging = tmp_path / "staging"
    base, new = step(50_000)
    options = EncodeOptions(max_chunk_bytes=16 << 10)
    first, first_chunks = encode(base, new, base_version=1, version=2, options=options)
    path = write_staged_delta(staging, first, first_chunks)
    assert not path.is_symlink()  # nothing offered yet: the disk
    manifest, chunks = load_staged_delta(staging, staged_message(path, 2, 1))
    assert manifest == first and list(chunks) == first_chunks
    assert [bytes(b) for b in chunks.bodies] == [encode_chunk(c) for c in first_chunks]
    assert (staging / SHM_OFFER).is_file()  # reading it offered shared memory

    _, newer = step(50_000, seed=1)
    second, second_chunks = encode(new, newer, base_version=2, version=3, options=options)
    path = write_staged_delta(staging, second, second_chunks)
    assert path.is_symlink() and path.resolve().parent.parent == shm
    manifest, chunks = load_staged_delta(staging, staged_message(path, 3, 2))
    out = decode(new, manifest, chunks)
    assert torch.equal(out["w"].view(torch.int16), newer["w"].view(torch.int16))
    in_shm = path.resolve()
    assert remove_staged_before(staging, 4) == [2, 3]
    assert not in_shm.exists() and not path.is_symlink()


def test_a_stopping_broadcaster_leaves_nothing_in_shared_memory_and_loses_no_delta(
    tmp_path: Path, shm: Path
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    handoff.offer_shm(staging)
    base, new = step(20_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    path = write_staged_delta(staging, manifest, chunks)
    assert path.is_symlink()
    handoff.release_shm(staging)
    assert list(shm.iterdir()) == [] and not (staging / SHM_OFFER).exists()
    assert path.is_file() and not path.is_symlink()  # still there for the next broadcaster
    got, got_chunks = load_staged_delta(staging, staged_message(path, 2, 1))
    assert got == manifest and list(got_chunks) == chunks


def test_a_delta_goes_to_disk_where_the_offered_memory_is_not_this_sides(
    tmp_path: Path, shm: Path
) -> None:
    staging = tmp_path / "staging"
    base, new = step(20_000)
    manifest, chunks = encode(base, new, base_version=1, version=2)
    handoff.offer_shm(staging.mkdir(parents=True) or staging)
    # Another host, or a container with a /dev/shm of its own: the token is not there.
    folder = next(shm.iterdir())
    (folder / SHM_OFFER).write_text("someone else's")
    path = write_staged_delta(staging, manifest, chunks)
    assert path.is_file() and not path.is_symlink()
    got, got_chunks = load_staged_delta(staging, staged_message(path, 2, 1))
    assert got == manifest and list(got_chunks) == chunks


def test_a_delta_file_whose_chunk_is_not_its_manifests_is_refused(tmp_path: Path) -> None:
    base, new = step(400_000)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=EncodeOptions(
        max_chunk_bytes=16 << 10))  # fmt: skip
    assert len(chunks) > 1
    header = msgspec.structs.replace(chunks[0].header, index=1)  # same size, wrong index
    write_delta_file(tmp_path / "v2.delta", manifest, [Chunk(header=header, payload=chunks[0]
        .payload), *chunks[1:]])  # fmt: skip
    with pytest.raises(CorruptDeltaError, match="not the one its manifest lists"):
        map_delta_file(tmp_path / "v2.delta")
    write_delta_file(tmp_path / "v2.delta", manifest, chunks)
    data = (tmp_path / "v2.delta").read_bytes()
    (tmp_path / "v2.delta").write_bytes(data[:-5])
    with pytest.raises(CorruptDeltaError, match="truncated"):
        map_delta_file(tmp_path / "v2.delta")


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65_535, 65_536, 1 << 20])
def test_a_chunk_prefix_and_its_payload_are_the_chunk_as_the_bus_stores_it(size: int) -> None:
    header = ChunkHeader(
        format_version=4, version=1, base_version=None, target_hash="ab", index=0, pieces=[],
        payload_hash="cd", output_hash="ef",
    )  # fmt: skip
    chunk = Chunk(header=header, payload=os.urandom(size))
    assert chunk_prefix(chunk) + chunk.payload == encode_chunk(chunk)


def test_nonzero_symbols_counts_every_packed_symbol_that_is_not_zero() -> None:
    per_byte = np.array([sum((b >> (2 * k)) & 3 != 0 for k in range(4)) for b in range(256)])
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 8, 9, 1001):
        packed = rng.integers(0, 256, size + 1, dtype=np.uint8)
        for view in (packed[:size], packed[1:]):  # aligned and not
            assert nonzero_symbols(view) == int(per_byte[view].sum())


def test_a_small_version_is_cut_into_chunks_for_many_cores_and_decodes_exactly() -> None:
    base, new = step(4_000_000)
    manifest, chunks = encode(base, new, base_version=1, version=2, options=EncodeOptions())
    encoded = sum(ref.num_bytes for ref in manifest.chunks)
    assert encoded < 4 << 20 and len(chunks) >= 2  # one 4 MiB chunk before
    out = decode(base, manifest, chunks)
    assert torch.equal(out["w"].view(torch.int16), new["w"].view(torch.int16))
