"""Trainer -> weight-broadcaster -> rollout-worker receiver on a real nats-server: bit-exact
versions, snapshots and catch-up, clean-up, restarts, and refusals of damaged versions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.trainer.staging import WeightStager
from libs.weights import BaseMismatchError, CorruptDeltaError, MissingChunkError
from libs.weights.announcements import latest_announcement
from libs.weights.encoder import EncodeOptions, encode
from libs.weights.format import encode_chunk
from libs.weights.handoff import (
    announce_staged_delta,
    stage_weights,
    staged_versions,
    write_staged_delta,
)
from libs.weights.receiver import (
    VERSION_ATTEMPTS,
    WeightReceiver,
)
from libs.weights.tensors import as_raw
from libs.weights.transport import chunk_subject, fetch_chunks
from proto import streams
from proto.messages import WeightAnnouncement, WeightsStaged
from proto.subjects import WEIGHTS_STAGED, weight_chunk_subject
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.signing_support import trusting

DEVICES = pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)

# Receivers decode in this process, as a worker whose weights are on the CPU does.
IN_PROCESS = trusting(decode_process=False)
SNAPSHOT_EVERY = 3  # versions 1 (first), 4, 7 are snapshot points

DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
    torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def trainer_state(seed: int) -> dict[str, torch.Tensor]:
    """Small random weights of every dtype, arbitrary bit patterns (NaN payloads, -0.0...)."""
    rng = np.random.default_rng(seed)
    state = {}
    for i, dtype in enumerate(DTYPES):
        width = torch.empty((), dtype=dtype).element_size()
        numel = 3000 + 517 * i
        data = rng.integers(0, 256, numel * width, dtype=np.uint8)
        if dtype == torch.bool:
            data &= 1
        state[f"layer.{i}.{str(dtype)[6:]}"] = torch.from_numpy(data).view(dtype).reshape(-1, 1)
    return state


def next_version(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A few percent of the elements get new bit patterns, like an RL step in bf16."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in state.items():
        units = as_raw(tensor).units().copy()
        picked = rng.random(units.size) < 0.03
        fresh = rng.integers(0, 2 ** (8 * units.itemsize), units.size, dtype=np.uint64)
        units[picked] = fresh[picked].astype(units.dtype)
        if tensor.dtype == torch.bool:
            units &= 1
        out[name] = torch.from_numpy(units.view(np.uint8)).view(tensor.dtype).reshape(tensor.shape)
    return out


def assert_bit_exact(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert np.array_equal(as_raw(got[name]).data, as_raw(tensor).data), name


class Harness:
    """A trainer (stage_weights), a running broadcaster service, and what was staged."""

    def __init__(self, bus: Bus, staging_dir: Path, **settings: Any) -> None:
        self.bus = bus
        self.settings = settings
        self.staging_dir = staging_dir
        self.publisher = Publisher(bus.js)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.service: WeightBroadcasterService | None = None
        self._task: asyncio.Task[None] | None = None

    async def start_broadcaster(self) -> WeightBroadcasterService:
        settings = WeightBroadcasterSettings(
            staging_dir=self.staging_dir,
            snapshot_every_versions=SNAPSHOT_EVERY,
            encode=EncodeOptions(max_chunk_bytes=16 << 10, threads=1),  # many chunks
            **self.settings,
        )
        self.service = WeightBroadcasterService(settings)
        await self.service.start(self.bus)
        self._task = asyncio.create_task(self.service.run())
        return self.service

    async def stop_broadcaster(self) -> None:
        assert self.service is not None and self._task is not None
        await self.service.stop()
        await asyncio.wait_for(self._task, 10)
        self.service, self._task = None, None

    def new_version(self, version: int) -> dict[str, torch.Tensor]:
        """The trainer's weights at `version` (the first, or a step from the one before)."""
        previous = self.versions.get(version - 1)
        state = trainer_state(0) if previous is None else next_version(previous, version)
        self.versions[version] = state
        return state

    async def stage(self, version: int) -> None:
        """The trainer's side: a new version, staged and handed over."""
        await stage_weights(self.publisher, self.staging_dir, self.new_version(version), version)

    def delta_stager(self) -> WeightStager:
        """The trainer's stager, encoding the versions after the first itself."""
        options = EncodeOptions(max_chunk_bytes=16 << 10)
        return WeightStager(self.publisher, self.staging_dir, deltas=True, options=options)

    async def stage_until(self, version: int) -> None:
        """Stage each version up to `version`, one at a time: each is announced before the
        next is staged (staged faster, the broadcaster skips versions superseded in its
        queue: tested on its own below)."""
        for v in range(max(self.versions, default=0) + 1, version + 1):
            await self.stage(v)
            await wait_for(self.announced(v), 20, f"version {v} announced")

    def announced(self, version: int) -> Any:
        async def check() -> bool:
            service = self.service
            head = service.broadcaster.head if service and service.broadcaster else None
            return head is not None and head.version >= version and not _snapshot_pending(head)

        return check


def _snapshot_pending(head: Any) -> bool:
    return bool(head.chain_length >= SNAPSHOT_EVERY)


@pytest.fixture
async def harness(bus: Bus, tmp_path: Path) -> AsyncIterator[Harness]:
    await provision(bus.js)
    h = Harness(bus, tmp_path / "staging")
    await h.start_broadcaster()
    yield h
    if h.service is not None:
        await h.stop_broadcaster()


async def assert_caught_up(harness: Harness, version: int) -> None:
    """A receiver starting from nothing reaches `version`, bit-exact with what was staged."""
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        await receiver.catch_up(state, version=version, timeout_s=20)
    finally:
        await receiver.close()
    assert_bit_exact(state, harness.versions[version])


async def receive(receiver: WeightReceiver, state: dict[str, Any]) -> tuple[str, float]:
    update = await asyncio.wait_for(receiver.next_update(), 20)
    pause_s = receiver.apply(update, state)
    return update.kind, pause_s


async def test_versions_arrive_bit_exact_and_in_place(harness: Harness) -> None:
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, trusting(fetch_parallel=4, decode_process=False))
    kinds = []
    try:
        for version in range(1, 6):
            await harness.stage(version)
            kind, pause_s = await receive(receiver, state)
            kinds.append(kind)
            assert pause_s >= 0 and receiver.current is not None
            assert receiver.current.version == version
            assert_bit_exact(state, harness.versions[version])
            if version == 1:
                storage = {n: t.data_ptr() for n, t in state.items()}
        # The model's own tensors were written in place, deltas and snapshot points alike.
        assert {n: t.data_ptr() for n, t in state.items()} == storage
    finally:
        await receiver.close()
    # The first version is a snapshot; a worker holding v-1 takes v's delta, never v's snapshot.
    assert kinds == ["snapshot", "delta", "delta", "delta", "delta"]
    health = harness.service.health() if harness.service else {}
    chain = (health["latest_version"], health["snapshot_version"], health["chain_length"])
    assert chain == (5, 4, 1)
    # Older staged files are deleted; the latest stays as the next delta's base.
    assert staged_versions(harness.staging_dir) == [5]


async def test_a_late_joiner_catches_up_from_the_snapshot_and_old_chunks_are_gone(
    harness: Harness,
) -> None:
    await harness.stage_until(6)  # snapshots at 1 and 4; deltas 2..6
    js = harness.bus.js
    # Nothing before the latest snapshot (4) is stored any more; 4's delta and snapshot are.
    for gone in (weight_chunk_subject(1, "snapshot", 0), weight_chunk_subject(3, "delta", 0)):
        with pytest.raises(NotFoundError):
            await js.get_msg(streams.WEIGHT_CHUNKS.name, subject=gone, direct=True)
    for kept in (weight_chunk_subject(4, "delta", 0), weight_chunk_subject(4, "snapshot", 0)):
        await js.get_msg(streams.WEIGHT_CHUNKS.name, subject=kept, direct=True)
    announced = await js.stream_info(streams.WEIGHTS_ANNOUNCE.name)
    assert announced.state.messages == 4  # delta 4, snapshot 4, delta 5, delta 6

    state: dict[str, Any] = {}
    late = WeightReceiver(harness.bus, trusting(fetch_parallel=8))
    try:
        kinds = [(await receive(late, state))[0] for _ in range(3)]
    finally:
        await late.close()
    assert kinds == ["snapshot", "delta", "delta"]
    assert late.current is not None and late.current.version == 6
    assert_bit_exact(state, harness.versions[6])


async def test_versions_staged_faster_than_broadcast_are_skipped_for_the_newest(
    harness: Harness,
) -> None:
    await harness.stage_until(1)
    await harness.stop_broadcaster()
    for version in (2, 3):  # staged while the broadcaster is busy (here: away)
        await harness.stage(version)
    await harness.start_broadcaster()
    await wait_for(harness.announced(3), 20, "version 3 announced")

    delta = await latest_announcement(harness.bus.js, "delta")
    assert delta is not None and (delta[1].version, delta[1].base_version) == (3, 1)
    with pytest.raises(NotFoundError):  # 2 was never encoded nor stored
        await harness.bus.js.get_msg(
            streams.WEIGHT_CHUNKS.name, subject=weight_chunk_subject(2, "delta", 0), direct=True
        )
    assert staged_versions(harness.staging_dir) == [3]  # 2's file is gone with it
    await assert_caught_up(harness, 3)


async def test_a_restarted_broadcaster_continues_the_chain(harness: Harness) -> None:
    await harness.stage_until(3)
    await harness.stop_broadcaster()
    # Its memory is gone, and so are the staged files: the base comes back from the bus.
    for path in harness.staging_dir.iterdir():
        path.unlink()
    service = await harness.start_broadcaster()
    assert service.broadcaster is not None and service.broadcaster.head is not None
    assert (service.broadcaster.head.version, service.broadcaster.head.chain_length) == (3, 2)

    await harness.stage_until(5)
    delta = await latest_announcement(harness.bus.js, "delta")
    snapshot = await latest_announcement(harness.bus.js, "snapshot")
    assert delta is not None and snapshot is not None
    assert (delta[1].version, delta[1].base_version) == (5, 4)
    assert snapshot[1].version == 4  # the snapshot came on schedule, not from a broken chain

    await assert_caught_up(harness, 5)


async def damage_first_chunk(harness: Harness, version: int) -> tuple[str, bytes]:
    """Store a copy of delta `version`'s first chunk with one bit flipped in its payload
    (what a reader then gets); returns its subject and the intact body."""
    announcement = await _announcement(harness.bus, "delta", version)
    good = await fetch_chunks(harness.bus.nc, announcement.manifest)
    intact = encode_chunk(good.chunks[0])
    body = bytearray(intact)
    body[-5] ^= 0x01
    subject = chunk_subject(announcement.manifest, 0)
    await harness.bus.js.publish(subject, bytes(body))
    return subject, intact


async def test_a_tampered_chunk_refuses_the_version_and_leaves_the_model_alone(
    harness: Harness,
) -> None:
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS, attempts=2)
    try:
        await harness.stage_until(1)
        await receive(receiver, state)
        await harness.stage_until(2)
        await damage_first_chunk(harness, 2)
        before = {n: as_raw(t).data.copy() for n, t in state.items()}

        for _ in range(VERSION_ATTEMPTS):  # read again: a damaged read may not last
            with pytest.raises(CorruptDeltaError, match="refused after 2 attempts"):
                await asyncio.wait_for(receiver.next_update(), 20)
        assert receiver.current is not None and receiver.current.version == 1
        assert all(np.array_equal(as_raw(state[n]).data, before[n]) for n in state)

        # Given up: the chain is broken for this worker; it waits for the next snapshot (4),
        # then follows.
        await harness.stage_until(5)
        kinds = [(await receive(receiver, state))[0] for _ in range(2)]
    finally:
        await receiver.close()
    assert kinds == ["snapshot", "delta"]
    assert_bit_exact(state, harness.versions[5])


async def test_a_version_refused_for_a_damaged_read_is_read_again(harness: Harness) -> None:
    """A refusal that need not last (a chunk read damaged, a timeout while a node dies) does
    not break the chain: the next call reads the same announcement again, and the version
    comes through once its chunks read intact. Skipping it would leave the worker waiting for
    a snapshot that a trainer starved of its samples never makes."""
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS, attempts=1)
    try:
        await harness.stage_until(1)
        await receive(receiver, state)
        await harness.stage_until(2)
        subject, intact = await damage_first_chunk(harness, 2)
        await harness.stage_until(3)  # a delta on 2: of no use without 2
        with pytest.raises(CorruptDeltaError, match="refused after 1 attempts"):
            await asyncio.wait_for(receiver.next_update(), 20)

        await harness.bus.js.publish(subject, intact)  # reads intact now
        kinds = [(await receive(receiver, state))[0] for _ in range(2)]
    finally:
        await receiver.close()
    assert kinds == ["delta", "delta"]
    assert_bit_exact(state, harness.versions[3])


async def test_a_worker_that_lost_a_delta_is_unblocked_by_an_idle_snapshot(
    bus: Bus, tmp_path: Path
) -> None:
    """Delta 2 lost (its chunk purged): the worker holding 1 cannot use 3 and waits for a
    snapshot. No version comes after 3 (a trainer waiting for that worker's samples stages
    none), so the broadcaster snapshots the head once it has been idle, and the worker takes
    it: bit-exact at 3."""
    await provision(bus.js)
    harness = Harness(bus, tmp_path / "staging", snapshot_when_idle_s=1.0)
    await harness.start_broadcaster()
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        await harness.stage_until(1)
        await receive(receiver, state)
        await harness.stage_until(2)
        lost = await _announcement(harness.bus, "delta", 2)
        subject = chunk_subject(lost.manifest, 0)
        await harness.bus.js.purge_stream(streams.WEIGHT_CHUNKS.name, subject=subject)
        await harness.stage_until(3)
        with pytest.raises(MissingChunkError):
            await asyncio.wait_for(receiver.next_update(), 20)

        kind, _ = await receive(receiver, state)  # waits for the idle snapshot
        assert kind == "snapshot" and receiver.current is not None
        assert receiver.current.version == 3
        assert_bit_exact(state, harness.versions[3])
        head = (
            harness.service.broadcaster.head
            if harness.service and harness.service.broadcaster
            else None
        )
        assert head is not None and (head.version, head.chain_length) == (3, 0)
        # Idle again, the head is a snapshot now: nothing more is published.
        before = await harness.bus.js.stream_info(streams.WEIGHTS_ANNOUNCE.name)
        await asyncio.sleep(2.5)
        after = await harness.bus.js.stream_info(streams.WEIGHTS_ANNOUNCE.name)
        assert after.state.last_seq == before.state.last_seq, "the head was snapshotted again"
    finally:
        await receiver.close()
        await harness.stop_broadcaster()


async def test_a_missing_chunk_refuses_the_version_loudly(harness: Harness) -> None:
    await harness.stage_until(2)
    announcement = await _announcement(harness.bus, "delta", 2)
    subject = chunk_subject(announcement.manifest, len(announcement.manifest.chunks) - 1)
    await harness.bus.js.purge_stream(streams.WEIGHT_CHUNKS.name, subject=subject)

    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        await receive(receiver, state)  # the snapshot of version 1
        with pytest.raises(MissingChunkError, match="not stored"):
            await asyncio.wait_for(receiver.next_update(), 20)
        assert receiver.current is not None and receiver.current.version == 1
    finally:
        await receiver.close()
    assert_bit_exact(state, harness.versions[1])


async def test_a_delta_on_another_base_is_refused(harness: Harness) -> None:
    await harness.stage_until(3)
    state: dict[str, Any] = {}
    ahead = WeightReceiver(harness.bus, IN_PROCESS)
    behind = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        await receive(ahead, state)  # holds version 1
        update_2 = await asyncio.wait_for(ahead.next_update(), 20)
        await receive(behind, {})
        update_2_again = await asyncio.wait_for(behind.next_update(), 20)
        ahead.apply(update_2, state)  # holds version 2
        with pytest.raises(BaseMismatchError, match="delta on 1"):
            ahead.apply(update_2_again, state)
    finally:
        await ahead.close()
        await behind.close()
    assert_bit_exact(state, harness.versions[2])


async def _announcement(bus: Bus, kind: str, version: int) -> WeightAnnouncement:
    found = await latest_announcement(bus.js, kind)
    assert found is not None and found[1].version == version
    return found[1]


@DEVICES
async def test_deltas_found_on_a_torch_device_arrive_bit_exact_across_a_restart(
    bus: Bus, tmp_path: Path, device: str
) -> None:
    await provision(bus.js)
    harness = Harness(bus, tmp_path / "staging", diff_device=device)
    await harness.start_broadcaster()
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, trusting(fetch_parallel=4, decode_process=False))
    kinds = []
    try:
        for version in range(1, 8):
            if version == 4:  # a restart: the device state is rebuilt from the staged file
                await harness.stop_broadcaster()
                await harness.start_broadcaster()
            await harness.stage(version)
            kinds.append((await receive(receiver, state))[0])
            assert receiver.current is not None and receiver.current.version == version
            assert_bit_exact(state, harness.versions[version])
    finally:
        await receiver.close()
        await harness.stop_broadcaster()
    assert kinds == ["snapshot"] + ["delta"] * 6


async def staged_kinds(bus: Bus) -> tuple[list[str], Any]:
    """Kinds of the WeightsStaged messages published from now on (a core subscription)."""
    kinds: list[str] = []

    async def seen(msg: Any) -> None:
        kinds.append(wire.decode(WeightsStaged, msg.data, msg.headers).kind)

    return kinds, await bus.nc.subscribe(WEIGHTS_STAGED, cb=seen)


@DEVICES
async def test_deltas_the_trainer_encodes_arrive_bit_exact_with_snapshots_on_schedule(
    harness: Harness, device: str
) -> None:
    stager = harness.delta_stager()
    kinds, subscription = await staged_kinds(harness.bus)
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    received = []
    try:
        for version in range(1, 8):
            new = harness.new_version(version)
            await stager.offer({n: t.to(device, copy=True) for n, t in new.items()}, version)
            await stager.flush()
            await wait_for(harness.announced(version), 20, f"version {version} announced")
            received.append((await receive(receiver, state))[0])
            assert_bit_exact(state, harness.versions[version])
    finally:
        await receiver.close()
        await subscription.unsubscribe()
        await stager.close()
    assert kinds == ["state"] + ["delta"] * 6  # only the first version crossed whole
    assert received == ["snapshot"] + ["delta"] * 6
    delta = await latest_announcement(harness.bus.js, "delta")
    assert delta is not None and (delta[1].version, delta[1].base_version) == (7, 6)
    # The snapshots (1, then every 3 deltas) came from the broadcaster's own copy of the
    # head, brought along by the trainer's deltas: a late joiner starts from version 7's.
    snapshot = await latest_announcement(harness.bus.js, "snapshot")
    assert snapshot is not None and snapshot[1].version == 7
    late: dict[str, Any] = {}
    joiner = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        assert (await receive(joiner, late))[0] == "snapshot"
    finally:
        await joiner.close()
    assert_bit_exact(late, harness.versions[7])
    assert staged_versions(harness.staging_dir) == []  # every handed-over file consumed


async def test_a_staged_delta_on_another_base_is_refused_and_the_chain_left_alone(
    harness: Harness,
) -> None:
    await harness.stage_until(2)
    service = harness.service
    assert service is not None and service.broadcaster is not None
    # A delta from 1 to 3, as a trainer that did not know 2 was staged would hand over.
    options = EncodeOptions(max_chunk_bytes=16 << 10)
    third = next_version(harness.versions[2], 3)
    manifest, chunks = encode(
        harness.versions[1], third, base_version=1, version=3, options=options
    )
    write_staged_delta(harness.staging_dir, manifest, chunks)
    await announce_staged_delta(harness.publisher, harness.staging_dir, 3, 1)
    await wait_for(
        lambda: service.broadcaster is not None and service.broadcaster.failures.num_failures > 0,
        20, "the staged delta refused",
    )  # fmt: skip
    assert "the trainer must stage the next version whole" in (
        service.broadcaster.failures.problem() or ""
    )
    assert service.broadcaster.head is not None and service.broadcaster.head.version == 2
    delta = await latest_announcement(harness.bus.js, "delta")
    assert delta is not None and delta[1].version == 2
    # The trainer stages its next version whole: the chain goes on from 2.
    harness.versions[4] = next_version(third, 4)
    await stage_weights(harness.publisher, harness.staging_dir, harness.versions[4], 4)
    await wait_for(harness.announced(4), 20, "version 4 announced")
    delta = await latest_announcement(harness.bus.js, "delta")
    assert delta is not None and (delta[1].version, delta[1].base_version) == (4, 2)
    await assert_caught_up(harness, 4)
    assert service.broadcaster.failures.problem() is None


async def test_the_trainer_hands_over_whole_when_the_chain_is_lost_on_either_side(
    harness: Harness,
) -> None:
    stager = harness.delta_stager()
    kinds, subscription = await staged_kinds(harness.bus)
    try:
        for version in range(1, 8):
            if version == 4:  # the bus loses the chain: the broadcaster starts a new one
                await harness.stop_broadcaster()
                await harness.bus.js.purge_stream(streams.WEIGHTS_ANNOUNCE.name)
                await harness.start_broadcaster()
            if version == 6:  # the trainer's encoder process dies
                assert stager._encoder is not None
                stager._encoder._process.kill()
            new = harness.new_version(version)
            await stager.offer({n: t.clone() for n, t in new.items()}, version)
            await stager.flush()
            await wait_for(harness.announced(version), 20, f"version {version} announced")
    finally:
        await subscription.unsubscribe()
        await stager.close()
    assert kinds == ["state", "delta", "delta", "state", "delta", "state", "delta"]
    await assert_caught_up(harness, 7)
