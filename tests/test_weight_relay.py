"""Weights relayed to a region on real servers: a hub (JetStream domain "hub") and a region
server (domain "region-a", a leaf node of the hub) whose weight streams are mirrors of the
hub's. Workers connected only to the region apply bit-exact versions, the link carries each
chunk once, late joiners catch up after the hub purged, and the region survives the hub
going away and picks up again when it is back."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from apps.cli import main as cli_main
from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.nats_server import NatsServer, free_port
from libs.policy import PolicyConfig
from libs.weights.broadcaster import WeightBroadcaster
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from libs.weights.hashing import state_hash
from libs.weights.receiver import WeightReceiver
from libs.weights.relay import RegionalWeightReceiver, mirror_status, prune_region, setup_relay
from libs.weights.tensors import raw_state
from proto import streams
from tests.conftest import state_trainer_policy, wait_for
from tests.marks import E2E
from tests.signing_support import SIGNER, trusting
from tests.test_weight_broadcaster import assert_bit_exact, next_version

pytestmark = E2E

HUB_DOMAIN = "hub"
SNAPSHOT_EVERY = 3  # versions 1 (first) and 4 are snapshot points
RELAYED = (streams.WEIGHTS_ANNOUNCE.name, streams.WEIGHT_CHUNKS.name)


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """1 MiB of bf16 weights with arbitrary bit patterns (incompressible, like real ones)."""
    rng = np.random.default_rng(seed)
    return {
        f"layer.{i}.weight": torch.from_numpy(rng.integers(0, 2**16, (256, 512), dtype=np.uint16))
        .view(torch.bfloat16)
        .clone()
        for i in range(4)
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, NatsServer]]:
    """The training cluster's server and one region's, linked as hub and leaf node."""
    hub = NatsServer(
        store_dir=tmp_path_factory.mktemp("hub"),
        jetstream_domain=HUB_DOMAIN,
        leafnode_port=free_port(),
    )
    hub.start()
    region = NatsServer(
        store_dir=tmp_path_factory.mktemp("region"),
        jetstream_domain="region-a",
        leaf_remotes=(hub.leafnode_url,),
    )
    region.start()
    try:
        yield hub, region
    finally:
        region.stop()
        hub.stop()


def leaf_link(server: NatsServer) -> dict[str, Any]:
    """The server's one leaf node connection, from its monitoring port (None: not up)."""
    url = f"http://{server.host}:{server.monitor_port}/leafz"
    with urllib.request.urlopen(url, timeout=2) as reply:
        leafs = json.load(reply)["leafs"]
    return leafs[0] if leafs else {}


def link_bytes_in(region: NatsServer) -> int:
    """Bytes the region has received from the hub over the leaf node link."""
    return int(leaf_link(region)["in_bytes"])


class Relay:
    """A broadcaster on the hub, mirrors in the region, and the versions published."""

    def __init__(self, hub: NatsServer, region: NatsServer, hub_bus: Bus, region_bus: Bus,
                 staging_dir: Path) -> None:  # fmt: skip
        self.hub, self.region = hub, region
        self.hub_bus, self.region_bus = hub_bus, region_bus
        self.staging_dir = staging_dir
        self.publisher = Publisher(hub_bus.js)
        self.broadcaster = WeightBroadcaster(
            hub_bus, self.publisher, staging_dir, signer=SIGNER, snapshot_every=SNAPSHOT_EVERY,
            options=EncodeOptions(max_chunk_bytes=64 << 10),
        )  # fmt: skip
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    async def publish_until(self, version: int) -> None:
        """The trainer stages each version; the broadcaster stores and announces it."""
        for v in range(max(self.versions, default=0) + 1, version + 1):
            previous = self.versions.get(v - 1)
            state = model_state(0) if previous is None else next_version(previous, v)
            self.versions[v] = state
            staged = await stage_weights(self.publisher, self.staging_dir, state, v)
            await self.broadcaster.on_staged(staged)

    async def wait_mirrored(
        self, timeout_s: float = 15.0, names: tuple[str, ...] = RELAYED
    ) -> None:
        """Until each regional mirror holds the hub's last message."""

        async def synced() -> bool:
            for name in names:
                hub_info = await self.hub_bus.js.stream_info(name)
                region_info = await self.region_bus.js.stream_info(name)
                if region_info.state.last_seq < hub_info.state.last_seq:
                    return False
            return True

        await wait_for(synced, timeout_s, "regional mirrors caught up with the hub")

    async def stored_bytes(self, bus: Bus) -> int:
        return sum([(await bus.js.stream_info(name)).state.bytes for name in RELAYED])

    async def first_seqs(self, bus: Bus) -> tuple[int, ...]:
        return tuple([(await bus.js.stream_info(name)).state.first_seq for name in RELAYED])


async def _clean(bus: Bus) -> None:
    for info in await bus.js.streams_info():
        assert info.config.name is not None
        await bus.js.delete_stream(info.config.name)


@pytest.fixture
async def relay(servers: tuple[NatsServer, NatsServer], tmp_path: Path) -> AsyncIterator[Relay]:
    hub, region = servers
    for server in (hub, region):
        if server.process is None or server.process.poll() is not None:
            server.start()  # a test that stopped it and failed before starting it again
    await wait_for(lambda: bool(leaf_link(region)), 15, "the region's leaf node link")
    hub_bus = await connect_bus(hub.url, name="pytest-hub")
    region_bus = await connect_bus(region.url, name="pytest-region")
    await _clean(region_bus)
    await _clean(hub_bus)
    hub_specs = (streams.WEIGHTS_STAGED, streams.WEIGHTS_ANNOUNCE, streams.WEIGHT_CHUNKS)
    await provision(hub_bus.js, stream_specs=hub_specs, consumer_specs=(), kv_specs=())
    report = await setup_relay(region_bus.js, HUB_DOMAIN)
    assert set(report.outcomes.values()) == {"created"}
    yield Relay(hub, region, hub_bus, region_bus, tmp_path / "staging")
    await hub_bus.close()
    await region_bus.close()


async def receive_until(
    receiver: WeightReceiver, state: dict[str, Any], version: int, timeout_s: float = 15.0
) -> int:
    """Apply updates until `state` holds `version`; returns the chunk bytes fetched."""
    fetched = 0
    while receiver.current is None or receiver.current.version != version:
        update = await asyncio.wait_for(receiver.next_update(), timeout_s)
        fetched += update.fetch.num_bytes
        await asyncio.to_thread(receiver.apply, update, state)
    return fetched


async def region_worker(region: NatsServer, version: int) -> tuple[dict[str, Any], str, int]:
    """A worker connected only to the region: its state, the hash it holds, bytes fetched."""
    bus = await connect_bus(region.url, name="pytest-region-worker")
    receiver = RegionalWeightReceiver(bus, trusting(fetch_parallel=4, decode_process=False))
    state: dict[str, Any] = {}
    try:
        fetched = await receive_until(receiver, state, version)
    finally:
        await receiver.close()
        await bus.close()
    assert receiver.current is not None
    return state, receiver.current.hash, fetched


def source_hash(state: dict[str, torch.Tensor]) -> str:
    return state_hash(raw_state(state))


async def test_region_workers_apply_bit_exact_and_the_link_carries_one_copy(relay: Relay) -> None:
    link_before = link_bytes_in(relay.region)
    await relay.publish_until(3)  # snapshot 1, deltas 2 and 3
    await relay.wait_mirrored()
    crossed_publish = link_bytes_in(relay.region) - link_before
    hub_bytes = await relay.stored_bytes(relay.hub_bus)
    # The region holds a byte-identical copy of what the hub stores...
    assert await relay.stored_bytes(relay.region_bus) == hub_bytes
    # ...and it took about one copy's worth of bytes on the link (plus protocol framing).
    # (Measured: 1,155,689 bytes in for 1,155,543 stored.)
    assert hub_bytes <= crossed_publish < 1.05 * hub_bytes, (crossed_publish, hub_bytes)

    link_mid = link_bytes_in(relay.region)
    (state_a, hash_a, fetched_a), (state_b, hash_b, fetched_b) = await asyncio.gather(
        region_worker(relay.region, 3), region_worker(relay.region, 3)
    )
    crossed_fetch = link_bytes_in(relay.region) - link_mid
    want = relay.versions[3]
    for state, held_hash in ((state_a, hash_a), (state_b, hash_b)):
        assert held_hash == source_hash(want)
        assert_bit_exact(state, want)
    # Two workers fetched the whole chain each, all of it from the region's mirrors: the
    # link carried nothing of it (only mirror heartbeats and flow control, if anything).
    assert fetched_a == fetched_b and fetched_a > 1_000_000
    assert crossed_fetch < 0.01 * (fetched_a + fetched_b), (crossed_fetch, fetched_a)
    status = await mirror_status(relay.region_bus.js)
    assert all(entry["lag"] == 0 for entry in status.values()), status


async def test_a_late_joiner_catches_up_in_the_region_after_the_hub_purged(relay: Relay) -> None:
    await relay.publish_until(3)
    await relay.wait_mirrored()  # (a message the hub purges before the mirror copied it is
    await relay.publish_until(5)  # never copied.) Snapshot 4: the hub purges before it.
    await relay.wait_mirrored()
    hub_first = await relay.first_seqs(relay.hub_bus)
    assert hub_first > (1, 1)
    # Mirrors do not replicate purges: the region still holds versions 1 to 3.
    assert await relay.first_seqs(relay.region_bus) == (1, 1)

    state, held, _ = await region_worker(relay.region, 5)
    assert held == source_hash(relay.versions[5])
    assert_bit_exact(state, relay.versions[5])

    # The region applies the hub's rule to its copies; then it holds what the hub holds.
    kept = await prune_region(relay.region_bus.js, SIGNER.verifier())
    assert kept is not None and kept.snapshot_version == 4
    assert await relay.first_seqs(relay.region_bus) == hub_first
    assert await relay.stored_bytes(relay.region_bus) == await relay.stored_bytes(relay.hub_bus)
    assert await prune_region(relay.region_bus.js, SIGNER.verifier()) == kept  # idempotent
    state, held, _ = await region_worker(relay.region, 5)
    assert held == source_hash(relay.versions[5])
    assert_bit_exact(state, relay.versions[5])


async def test_the_region_serves_while_the_hub_is_away_and_resumes_after(relay: Relay) -> None:
    await relay.publish_until(2)
    await relay.wait_mirrored()
    bus = await connect_bus(relay.region.url, name="pytest-region-follower")
    follower = RegionalWeightReceiver(bus, trusting(fetch_parallel=4, decode_process=False))
    follower_state: dict[str, Any] = {}
    try:
        await receive_until(follower, follower_state, 2)
        relay.hub.stop()
        await wait_for(lambda: not leaf_link(relay.region), 10, "the link to go down")
        # A new worker in the region catches up from the mirrors alone.
        state, held, _ = await region_worker(relay.region, 2)
        assert held == source_hash(relay.versions[2])
        assert_bit_exact(state, relay.versions[2])

        relay.hub.start()
        await wait_for(lambda: relay.hub_bus.nc.is_connected, 10, "the hub client back")
        await relay.publish_until(3)
        # The mirrors resume on their own (the server notices the lost mirror consumer and
        # makes a new one, measured at about 14 s); the follower gets version 3 from the region.
        await receive_until(follower, follower_state, 3, timeout_s=40)
        assert_bit_exact(follower_state, relay.versions[3])
    finally:
        await follower.close()
        await bus.close()


async def test_relay_setup_command_is_idempotent_and_refuses_a_plain_stream(
    relay: Relay, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["weights", "relay-setup", "--hub-domain", HUB_DOMAIN, "--nats-url", relay.region.url]
    assert await asyncio.to_thread(cli_main, argv) == 0
    assert "unchanged  mirror RL_WEIGHT_CHUNKS" in capsys.readouterr().out
    capped = [*argv, "--max-bytes", str(1 << 30)]
    assert await asyncio.to_thread(cli_main, capped) == 0
    assert "updated  mirror RL_WEIGHTS_ANNOUNCE" in capsys.readouterr().out
    info = await relay.region_bus.js.stream_info(streams.WEIGHT_CHUNKS.name)
    assert info.config.max_bytes == 1 << 30 and info.config.mirror is not None

    # A service that provisioned the hub's streams on the regional server left a plain
    # stream there: the command says so and how to fix it.
    await relay.region_bus.js.delete_stream(streams.WEIGHT_CHUNKS.name)
    await provision(
        relay.region_bus.js, stream_specs=(streams.WEIGHT_CHUNKS,), consumer_specs=(), kv_specs=()
    )
    assert await asyncio.to_thread(cli_main, argv) == 2
    err = capsys.readouterr().err
    assert "RL_WEIGHT_CHUNKS in this domain is a plain stream" in err and "nats stream rm" in err


async def test_a_regional_receiver_waits_for_chunks_announced_before_they_arrived(
    relay: Relay,
) -> None:
    # The two mirrors copy independently; here the chunk mirror is missing entirely when the
    # announcement arrives (as a snapshot far behind its announcement on a slow link would be).
    # A plain WeightReceiver would refuse the version (a missing chunk means gone on the hub).
    await relay.region_bus.js.delete_stream(streams.WEIGHT_CHUNKS.name)
    await relay.publish_until(1)
    await relay.wait_mirrored(names=(streams.WEIGHTS_ANNOUNCE.name,))
    bus = await connect_bus(relay.region.url, name="pytest-region-worker")
    try:
        regional = RegionalWeightReceiver(bus, trusting(fetch_timeout_s=1.0, decode_process=False))
        state: dict[str, Any] = {}
        task = asyncio.create_task(receive_until(regional, state, 1))
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for the chunks, not refusing the version
        await setup_relay(relay.region_bus.js, HUB_DOMAIN)
        await asyncio.wait_for(task, 15)
        assert_bit_exact(state, relay.versions[1])
        await regional.close()
    finally:
        await bus.close()


async def test_a_rollout_worker_in_a_region_takes_its_weights_from_the_relay(
    relay: Relay, tmp_path: Path
) -> None:
    """The worker's service connection is the hub (tasks, rollouts, the trainer's state);
    with `weights.nats_url` its weights come from the region's mirrors."""
    from libs.policy import build_policy
    from services.rollout_worker.service import RolloutWorkerService
    from services.rollout_worker.settings import RolloutWorkerSettings

    policy = build_policy(PolicyConfig(device="cpu", seed=5))
    published = {name: t.detach().clone() for name, t in policy.state_dict().items()}
    staged = await stage_weights(relay.publisher, relay.staging_dir, published, 1)
    await relay.broadcaster.on_staged(staged)
    await relay.wait_mirrored()

    service_bus = await connect_bus(relay.hub.url, name="pytest-region-rollout-worker")
    await provision(service_bus.js)  # what `rlpipe run` does before the service starts
    await state_trainer_policy(service_bus.js)
    settings = RolloutWorkerSettings(
        worker_id="region-worker", policy=PolicyConfig(device="cpu", seed=9),
        weights=trusting(nats_url=relay.region.url),
        fetch_timeout_s=0.2, drain_timeout_s=2.0, http_port=0,
    )  # fmt: skip
    worker = RolloutWorkerService(settings)
    await worker.start(service_bus)
    running = asyncio.create_task(worker.run())
    link_before = link_bytes_in(relay.region)
    try:
        await wait_for(lambda: worker.engine_version == 1, 30, "the worker applied version 1")
        assert worker.regional_bus is not None
        live = worker.engine.live_tensors() if worker.engine is not None else None
        assert live is not None
        for name, tensor in published.items():
            assert torch.equal(live[name].cpu(), tensor), name
        # The chunks came from the region's mirror, not over the link again.
        assert link_bytes_in(relay.region) - link_before < 0.05 * staged.num_bytes
    finally:
        await worker.stop()
        await asyncio.wait_for(running, timeout=15)
        await service_bus.close()
