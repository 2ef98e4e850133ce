"""Weight versions decoded in a process of its own (libs/weights/decode_process.py), against
a host mirror: the parent's tensors are written in place, bit-exact; refusals come back as the
codec's errors; a mirror that fell behind the state is refilled, one that is wrong is caught;
a dead child is replaced. On CPU tensors in shared memory (the child writes them), in private
memory and on a GPU (mirrored; the `cuda` cases skip without one), and through the receiver
on a real nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.weights import BaseMismatchError, CorruptDeltaError, VersionInfo, decode_process
from libs.weights.decode_process import DecodeProcess, DecodeProcessError
from libs.weights.encoder import EncodeOptions, encode
from libs.weights.format import Chunk
from libs.weights.hashing import state_hash
from libs.weights.receiver import WeightReceiver
from libs.weights.tensors import raw_state
from tests.signing_support import trusting
from tests.test_weight_broadcaster import (
    Harness,
    assert_bit_exact,
    next_version,
    trainer_state,
)

SMALL = EncodeOptions(max_chunk_bytes=16 << 10)  # many chunks and pieces
# "shared": CPU tensors in shared memory, which the child writes itself; "cpu": private CPU
# memory, mirrored and written by the parent as GPU tensors are.
DEVICES = [
    "shared",
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    ),
]


def live_state(values: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """Copies of `values` on `device` (see DEVICES)."""
    if device == "shared":
        return {name: tensor.clone().share_memory_() for name, tensor in values.items()}
    return {name: tensor.clone().to(device) for name, tensor in values.items()}


def host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cpu() for name, tensor in state.items()}


def delta(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int) -> Any:
    return encode(host(base), host(new), base_version=version - 1, version=version, options=SMALL)


def base_info(state: dict[str, torch.Tensor], version: int) -> VersionInfo:
    return VersionInfo(version=version, hash=state_hash(raw_state(host(state))))


@pytest.fixture
def decoder() -> Any:
    process = DecodeProcess(threads=2)
    yield process
    process.close()


@pytest.mark.parametrize("device", DEVICES)
def test_the_child_writes_the_parents_tensors_in_place_bit_exact(
    decoder: DecodeProcess, device: str
) -> None:
    v1 = trainer_state(0)
    state = live_state(v1, device)
    pointers = {name: tensor.data_ptr() for name, tensor in state.items()}
    current = base_info(state, 1)
    for version in (2, 3, 4):  # the state travels once; later versions reuse it
        old = {name: tensor.clone() for name, tensor in host(state).items()}
        new = next_version(old, version)
        manifest, chunks = delta(state, new, version)
        assert decoder.accepts(state, manifest)
        wall_s, cpu_s = decoder.prepare(state, manifest, current, chunks)
        assert wall_s > 0 and cpu_s > 0
        assert_bit_exact(host(state), old)  # prepared, not written
        current = decoder.commit(manifest)
        assert current == VersionInfo(version=version, hash=manifest.target_hash)
        assert_bit_exact(host(state), new)
    assert {name: tensor.data_ptr() for name, tensor in state.items()} == pointers


@pytest.mark.parametrize("device", ["shared", "cpu"])
def test_prepare_reads_only_and_refusals_come_back_as_the_codecs_errors(
    decoder: DecodeProcess, device: str
) -> None:
    state = live_state(trainer_state(0), device)
    before = host({name: tensor.clone() for name, tensor in state.items()})
    new = next_version(host(state), 2)
    manifest, chunks = delta(state, new, 2)
    wrong_base = VersionInfo(version=1, hash="0" * 64)
    with pytest.raises(BaseMismatchError):
        decoder.prepare(state, manifest, wrong_base, chunks)
    damaged = bytearray(chunks[0].payload)
    damaged[len(damaged) // 2] ^= 0x40
    chunks_damaged = [Chunk(header=chunks[0].header, payload=bytes(damaged)), *chunks[1:]]
    with pytest.raises(CorruptDeltaError):
        decoder.prepare(state, manifest, base_info(state, 1), chunks_damaged)
    assert_bit_exact(host(state), before)
    with pytest.raises(DecodeProcessError, match="was not prepared"):
        decoder.commit(manifest)  # the refused prepare left nothing to commit
    decoder.prepare(state, manifest, base_info(state, 1), chunks)
    other, _ = delta(state, next_version(host(state), 9), 3)
    with pytest.raises(DecodeProcessError, match="version 3 to commit, 2 prepared"):
        decoder.commit(other)
    assert_bit_exact(host(state), before)


@pytest.mark.parametrize("device", ["shared", "cpu"])
def test_a_dead_child_is_reported_and_replaced(decoder: DecodeProcess, device: str) -> None:
    state = live_state(trainer_state(0), device)
    new = next_version(host(state), 2)
    manifest, chunks = delta(state, new, 2)
    decoder.prepare(state, manifest, base_info(state, 1), chunks)
    pid = decoder._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    decoder._process.join(10)
    with pytest.raises(DecodeProcessError, match="died"):
        decoder.commit(manifest)
    decoder.prepare(state, manifest, base_info(state, 1), chunks)  # a new child, sent the state
    assert decoder._process.pid != pid
    assert decoder.commit(manifest).version == 2
    assert_bit_exact(host(state), new)
    # A child that dies between versions: the next prepare starts another and sends it the
    # state before the version.
    newer = next_version(host(state), 3)
    manifest, chunks = delta(state, newer, 3)
    pid = decoder._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    decoder._process.join(10)
    decoder.prepare(state, manifest, base_info(state, 2), chunks)
    assert decoder.commit(manifest).version == 3
    assert_bit_exact(host(state), newer)


def test_versions_the_child_cannot_take_are_declined(
    decoder: DecodeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = trainer_state(0)
    new = next_version(values, 2)
    manifest, _ = delta(values, new, 2)
    state = live_state(values, "cpu")
    assert not decoder.accepts(dict(list(state.items())[1:]), manifest)  # a tensor it lacks
    reshaped = dict(state)
    first = next(iter(reshaped))
    reshaped[first] = reshaped[first].reshape(1, -1)
    assert not decoder.accepts(reshaped, manifest)
    strided = dict(state)
    strided[first] = torch.empty(state[first].shape[0], 2, dtype=state[first].dtype)[:, :1]
    assert not decoder.accepts(strided, manifest)  # a view the codec cannot write in place
    assert decoder.accepts(state, manifest)
    # A mirror /dev/shm cannot hold: declined (the receiver decodes in its own threads)...
    usage = decode_process.shutil.disk_usage(decode_process.SHM_PATH)
    monkeypatch.setattr(decode_process.shutil, "disk_usage", lambda path: usage._replace(free=0))
    assert not decoder.accepts(state, manifest)
    # ...but tensors already in shared memory need none.
    assert decoder.accepts(live_state(values, "shared"), manifest)


@pytest.mark.parametrize("device", DEVICES[1:])
def test_a_mirror_behind_the_state_is_refilled_and_a_wrong_one_is_caught(
    decoder: DecodeProcess, device: str
) -> None:
    state = live_state(trainer_state(0), device)
    v2 = next_version(host(state), 2)
    manifest, chunks = delta(state, v2, 2)
    decoder.prepare(state, manifest, base_info(state, 1), chunks)
    decoder.commit(manifest)
    # Version 3 written by someone else (the receiver applies snapshots itself).
    v3 = next_version(v2, 3)
    for name, tensor in state.items():
        tensor.copy_(v3[name])
    v4 = next_version(v3, 4)
    manifest, chunks = delta(state, v4, 4)
    decoder.prepare(state, manifest, base_info(state, 3), chunks)
    assert decoder.commit(manifest) == VersionInfo(version=4, hash=manifest.target_hash)
    assert_bit_exact(host(state), v4)
    # A mirror that says it holds the base but differs from it: no chunk decodes against it.
    assert decoder._mirror is not None
    name = max(decoder._mirror.tensors, key=lambda n: decoder._mirror.tensors[n].numel())
    decoder._mirror.tensors[name].view(torch.uint8).bitwise_xor_(1)
    v5 = next_version(v4, 5)
    manifest, chunks = delta(state, v5, 5)
    with pytest.raises(CorruptDeltaError, match="output hash"):
        decoder.prepare(state, manifest, base_info(state, 4), chunks)
    assert_bit_exact(host(state), v4)


async def test_the_receiver_decodes_deltas_in_the_child_bit_exact(bus: Bus, tmp_path: Path) -> None:
    await provision(bus.js)
    harness = Harness(bus, tmp_path / "staging")
    await harness.start_broadcaster()
    state = live_state({n: torch.zeros_like(t) for n, t in trainer_state(0).items()}, "cpu")
    pointers = {name: tensor.data_ptr() for name, tensor in state.items()}
    receiver = WeightReceiver(harness.bus, trusting(fetch_parallel=4, decode_threads=2))
    in_child = []
    try:
        for version in range(1, 6):
            await harness.stage_until(version)
            update = await receiver.next_update()
            await asyncio.to_thread(receiver.decode, update, state)
            in_child.append((update.kind, update.decoded_in_child))
            receiver.apply(update, state)
            assert receiver.current is not None and receiver.current.version == version
            assert_bit_exact(state, harness.versions[version])
    finally:
        await receiver.close()
        await harness.stop_broadcaster()
    # The first version is a snapshot, decoded here (written into the zeros in place).
    assert in_child == [("snapshot", False)] + [("delta", True)] * 4
    assert {name: tensor.data_ptr() for name, tensor in state.items()} == pointers
