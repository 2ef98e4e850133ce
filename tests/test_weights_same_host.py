"""Weights handed over in memory on the trainer's host (libs/weights/same_host.py): a version
crosses to another process bit for bit, a slot rewritten under a copy or a copy that does
not sum to the trainer's is refused, and a rollout worker takes the trainer's versions this
way, then follows the delta chain again when they stop coming.
Run: .venv/bin/python -m pytest tests/test_weights_same_host.py -q
"""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import torch

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.engine.base import InferenceEngine
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.weights_follower import WeightsFollower
from libs.tokenizer import ByteTokenizer
from libs.weights.handoff import stage_weights
from libs.weights.receiver import WeightReceiver
from libs.weights.same_host import (
    ChecksumMismatchError,
    SameHostShareConfig,
    SameHostTakeConfig,
    SameHostUnavailable,
    ShelfReader,
    ShelfWriter,
    TornCopyError,
    checksum,
)
from libs.weights.same_host_link import SameHostSharer, SameHostTaker
from proto.same_host import SameHostShelf, SameHostVersion
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.signing_support import KEYS, trusting


def awkward_state() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes that are no multiple of a word, with bit patterns
    a cast would change (NaN payloads, -0.0)."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(33, 7, generator=generator).to(torch.bfloat16)
    weights.view(torch.int16)[0, :3] = torch.tensor([0x7FC1, -32768, 0x7F81], dtype=torch.int16)
    return {
        "embed.weight": weights,
        "norm.weight": torch.randn(13, generator=generator),
        "counts": torch.arange(-5, 6, dtype=torch.int8),
    }


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _copy_in_child(shelf: bytes, notice: bytes, out: str) -> None:
    """Another process: map the shelf, copy the notice's version into tensors on the
    shelf's device, save what it got."""
    description = wire.decode(SameHostShelf, shelf, None)
    version = wire.decode(SameHostVersion, notice, None)
    device = "cuda" if description.kind == "cuda_ipc" else "cpu"
    live = {
        entry.name: torch.zeros(entry.shape, dtype=getattr(torch, entry.dtype), device=device)
        for entry in description.tensors
    }
    reader = ShelfReader.open(description)
    reader.copy_into(live, version)
    reader.close()
    torch.save({name: tensor.cpu() for name, tensor in live.items()}, out)


@pytest.mark.parametrize("device", DEVICES)
def test_a_version_crosses_to_another_process_bit_for_bit(tmp_path: Path, device: str) -> None:
    """CPU: POSIX shared memory; CUDA: the card's memory through IPC."""
    state = {name: tensor.to(device) for name, tensor in awkward_state().items()}
    writer = ShelfWriter.create(state, host_id="test-host", num_slots=2)
    try:
        writer.write(state, version=1)
        state["norm.weight"] += 1.0
        notice = writer.write(state, version=2)
        assert notice.slot == 1
        assert notice.checksum == checksum(state.values())
        out = tmp_path / "copied.pt"
        context = multiprocessing.get_context("spawn")
        child = context.Process(
            target=_copy_in_child,
            args=(wire.encode(writer.description), wire.encode(notice), str(out)),
        )
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 0
    finally:
        writer.close()
    copied = torch.load(out)
    assert list(copied) == list(state)
    for name, tensor in state.items():
        assert copied[name].dtype == tensor.dtype and copied[name].shape == tensor.shape
        assert copied[name].view(torch.uint8).equal(tensor.cpu().view(torch.uint8)), name


def test_a_slot_rewritten_under_a_copy_or_a_wrong_sum_is_refused() -> None:
    # One process maps its own POSIX block; CUDA cannot open its own IPC handle, and the
    # header check is the same code on either.
    state = awkward_state()
    writer = ShelfWriter.create(state, host_id="test-host", num_slots=2)
    reader = ShelfReader.open(writer.description)
    live = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    try:
        first = writer.write(state, version=1)
        writer.write(state, version=2)
        writer.write(state, version=3)  # slot 0 again: version 1 is gone
        with pytest.raises(TornCopyError, match="holds version 3, not 1"):
            reader.copy_into(live, first)
        assert all(not tensor.any() for tensor in live.values()), "nothing was written"
        newest = writer.write(state, version=4)
        forged = SameHostVersion(
            shelf_id=newest.shelf_id, version=4, slot=newest.slot, checksum=newest.checksum + 1
        )
        with pytest.raises(ChecksumMismatchError):
            reader.copy_into(live, forged)
        reader.copy_into(live, newest)
        for name, tensor in state.items():
            assert live[name].view(torch.uint8).equal(tensor.view(torch.uint8))
    finally:
        reader.close()
        writer.close()


def test_a_shelf_another_process_cannot_map_is_unavailable() -> None:
    state = awkward_state()
    writer = ShelfWriter.create(state, host_id="test-host", num_slots=2)
    description = writer.description
    writer.close()  # unlinked: as a block of another machine
    with pytest.raises(SameHostUnavailable, match="cannot map shelf"):
        ShelfReader.open(description)
    cuda = SameHostShelf(
        shelf_id="x", host_id="test-host", kind="cuda_ipc", device_uuid="GPU-none",
        slots=[], tensors=[],
    )  # fmt: skip
    with pytest.raises(SameHostUnavailable):
        ShelfReader.open(cuda)


@pytest.mark.parametrize("engine_type", ["hf", "paged"])
async def test_a_worker_takes_its_hosts_versions_then_the_chain_when_they_stop(
    bus: Bus, tmp_path: Path, engine_type: str
) -> None:
    """Version 1 comes from the trainer's memory (the chain is not followed meanwhile); the
    trainer then stops sharing and version 2 arrives only on the chain: after
    `fallback_after_s` the worker takes it from there. The paged engine is written between
    decode steps, the hf engine between calls."""
    await provision(bus.js)
    staging = tmp_path / "staging"
    broadcaster = WeightBroadcasterService(WeightBroadcasterSettings(staging_dir=staging))
    await broadcaster.start(bus)
    broadcasting = asyncio.create_task(broadcaster.run())
    trainer_model = build_policy(PolicyConfig(preset="tiny", seed=0))
    sharer = SameHostSharer(
        bus, SameHostShareConfig(host_id="host-a", signing_key=KEYS.private_path)
    )
    worker_model = build_policy(PolicyConfig(preset="tiny", seed=1))
    engine: InferenceEngine = (
        HFEngine(worker_model, ByteTokenizer())
        if engine_type == "hf"
        else PagedEngine(worker_model, ByteTokenizer(), 64)
    )
    receiver = WeightReceiver(bus, trusting(fetch_timeout_s=5.0, decode_process=False))
    config = SameHostTakeConfig(host_id="host-a", fallback_after_s=1.0)
    taker = SameHostTaker(bus, config, receiver.verifier)
    follower = WeightsFollower(
        engine,
        receiver,
        GenerationBatcher(engine),
        same_host=taker,
    )
    await follower.start(bus.js)
    following = asyncio.create_task(follower.run())
    try:
        published = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
        assert await sharer.share(published, version=1, step=1) is not None
        await wait_for(lambda: follower.policy_version == 1, 30.0, "version 1 taken in memory")
        assert taker.num_applied == 1
        live = engine.live_tensors()
        assert live is not None
        for name, tensor in published.items():
            assert live[name].equal(tensor), name
        await sharer.close()

        with torch.no_grad():
            for tensor in published.values():
                tensor.mul_(0.5)
        await stage_weights(Publisher(bus.js), staging, published, 2)
        await wait_for(lambda: follower.policy_version == 2, 60.0, "version 2 from the chain")
        assert taker.num_applied == 1, "version 2 came by the chain"
        for name, tensor in published.items():
            assert live[name].equal(tensor), name
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await taker.close()
        await sharer.close()
        await broadcaster.stop()
        await asyncio.wait_for(broadcasting, timeout=10)
