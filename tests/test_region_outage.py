"""A region on its own server, through a link outage: the hub and one region on loopback
(tests/region_support.py: the shipped hub.conf and region-leaf.conf, every service its own
user), the leaf link through a TCP relay this test cuts. The region was set up as
docs/regions.md says (`rlpipe region setup` on the region, `rlpipe region hub-setup` on the
hub: libs/region/), and its services connect to the regional server only.

- the bus: the region's env-gateway takes tasks from the hub's queue into the region's, its
  worker's rollouts reach the hub's raw stream once each, and every user stays within its
  permissions;
- weights: a worker that fell behind while the link was down (the hub purged the versions it
  missed) catches up from the snapshot and the chain in the region's mirrors;
- the whole run: the link is cut for 60 s mid-run, the regional worker keeps rolling out its
  buffered tasks, and after the link returns every rollout it made reaches the hub once (by
  ids) and the trainer trains on them and on what the region makes next.

Run: .venv/bin/python -m pytest tests/test_region_outage.py -q
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from libs.bus import wire
from libs.bus.connection import Bus, NatsOptions, connect_bus
from libs.bus.publisher import Outgoing, Publisher
from libs.envs.feeder import FeederConfig
from libs.nats_server import NatsServer
from libs.policy import PolicyConfig
from libs.region.hub import source_regions
from libs.region.intake import TaskIntake, TaskIntakeConfig
from libs.region.setup import setup_region
from libs.service import Service
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.metrics import read_step_samples, read_steps
from libs.weights.broadcaster import WeightBroadcaster
from libs.weights.encoder import EncodeOptions
from libs.weights.relay import RegionalWeightReceiver
from libs.weights.same_host import SameHostShareConfig, SameHostTakeConfig
from proto import streams, subjects
from proto.messages import Rollout, ScoredRollout, Task
from proto.regions import HUB_DOMAIN, REGION_WORKER_TASKS, REGIONS, ROLLOUTS_OUTBOX
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.marks import E2E
from tests.region_support import LinkCutter, hub_user, linked_servers, region_user
from tests.signing_support import SIGNER, trusting
from tests.test_weight_broadcaster import assert_bit_exact, next_version
from tests.test_weight_relay import leaf_link, model_state, receive_until

pytestmark = E2E

OUTAGE_S = 60.0


def violations(*servers: NatsServer) -> list[str]:
    """Permission violations either server logged."""
    lines = []
    for server in servers:
        log = (server.store_dir / "nats-server.log").read_text().splitlines()
        lines += [line for line in log if "Violation" in line]
    return lines


async def set_up_region(hub: NatsServer, region: NatsServer) -> None:
    """What docs/regions.md runs: the hub's sources (as its admin), the region's streams (as
    the region's relay)."""
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    relay = await connect_bus(region.url, "relay", options=region_user("relay"))
    try:
        await source_regions(admin.js, REGIONS)
        await setup_region(relay.js, HUB_DOMAIN)
    finally:
        await admin.close()
        await relay.close()


def link_is_up(hub: NatsServer) -> bool:
    return bool(leaf_link(hub))


# --- the bus -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, NatsServer]]:
    with linked_servers(tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("region")) as pair:
        asyncio.run(set_up_region(*pair))
        yield pair


def a_rollout(task: Task, index: int) -> Rollout:
    return Rollout(
        rollout_id=f"{task.task_id}.{index}",
        task_id=task.task_id,
        group_id=task.task_id,
        sample_index=index,
        env=task.env,
        turns=[],
        finish_reason="stop",
        worker_id="region-worker",
        task=task,
    )


async def test_a_region_takes_tasks_from_the_hub_and_its_rollouts_reach_the_hub_once(
    servers: tuple[NatsServer, NatsServer],
) -> None:
    hub, region = servers
    await wait_for(lambda: link_is_up(hub), 30, "the region's leaf link")
    feeder = await connect_bus(hub.url, "env-gateway", options=hub_user("env-gateway"))
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    gateway = await connect_bus(region.url, "region-gateway", options=region_user("env-gateway"))
    worker = await connect_bus(region.url, "region-worker", options=region_user("rollout-worker"))
    try:
        tasks = [
            Task(task_id=f"bus-{i}", env="arith", prompt="1+1=", group_size=2) for i in range(3)
        ]
        await Publisher(feeder.js).publish_many(
            Outgoing(subjects.task_subject("arith"), t, t.task_id) for t in tasks
        )
        # The intake fills the region's buffer (2) from the hub's queue, and no more.
        intake = TaskIntake(gateway, TaskIntakeConfig(hub_domain=HUB_DOMAIN, buffer_tasks=2))
        await intake.start()

        async def took_two() -> bool:
            await intake.take_once()
            return intake.num_taken >= 2

        await wait_for(took_two, 30, "tasks taken from the hub")
        assert await intake.take_once() == 0 and await intake.buffered() == 2
        assert intake.link_up
        hub_left = await admin.js.stream_info(streams.TASKS.name)
        assert hub_left.state.messages == 1  # acked on the hub once stored in the region

        # A regional worker takes them there and writes its rollouts into the outbox.
        spec = REGION_WORKER_TASKS
        sub = await worker.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
        taken = [wire.decode(Task, m.data, m.headers) for m in await sub.fetch(2, timeout=10)]
        assert {t.task_id for t in taken} <= {t.task_id for t in tasks}
        publisher = Publisher(worker.js)
        rollouts = [a_rollout(task, i) for task in taken for i in range(2)]
        acks = await publisher.publish_many(
            Outgoing(subjects.rollout_raw_subject("arith"), r, r.rollout_id) for r in rollouts
        )
        assert {ack.stream for ack in acks} == {ROLLOUTS_OUTBOX.name}
        # A retry of one (same id) is stored once, in the region and on the hub.
        again = await publisher.publish(
            subjects.rollout_raw_subject("arith"), rollouts[0], rollouts[0].rollout_id
        )
        assert again.duplicate

        async def arrived() -> bool:
            info = await admin.js.stream_info(streams.ROLLOUTS_RAW.name)
            return int(info.state.messages) >= len(rollouts)

        await wait_for(arrived, 60, "the region's rollouts on the hub")
        raw = await admin.js.stream_info(streams.ROLLOUTS_RAW.name)
        ids = []
        for seq in range(raw.state.first_seq, raw.state.last_seq + 1):
            msg = await admin.js.get_msg(streams.ROLLOUTS_RAW.name, seq)
            ids.append(wire.decode(Rollout, msg.data or b"", dict(msg.headers or {})).rollout_id)
        assert sorted(ids) == sorted(r.rollout_id for r in rollouts)
        await admin.js.purge_stream(streams.ROLLOUTS_RAW.name)

        # The trainer's state, as the region's workers read it: the hub's, mirrored.
        kv = await admin.js.key_value(streams.STATE.bucket)
        await kv.put(streams.POLICY_VERSION_KEY, b"7")

        async def mirrored() -> bool:
            try:
                entry = await (await worker.js.key_value(streams.STATE.bucket)).get(
                    streams.POLICY_VERSION_KEY
                )
            except Exception:  # not there yet
                return False
            return entry.value == b"7"

        await wait_for(mirrored, 30, "the trainer's state in the region")
        assert not violations(hub, region)
    finally:
        for bus in (feeder, admin, gateway, worker):
            await bus.close()


# --- weights: far behind after an outage -----------------------------------------------------


@pytest.fixture
def cut_servers(tmp_path: Path) -> Iterator[tuple[NatsServer, NatsServer, LinkCutter]]:
    link = LinkCutter()
    with linked_servers(tmp_path / "hub", tmp_path / "region", link=link) as (hub, region):
        asyncio.run(set_up_region(hub, region))
        yield hub, region, link


async def test_a_worker_far_behind_after_an_outage_catches_up_from_the_regions_mirrors(
    cut_servers: tuple[NatsServer, NatsServer, LinkCutter], tmp_path: Path
) -> None:
    """While the link is down the hub moves on and purges the versions the region missed;
    after it returns the region's mirrors hold the hub's snapshot and the deltas after it
    (never the purged ones), and the worker takes that snapshot and the chain."""
    hub, region, link = cut_servers
    await wait_for(lambda: link_is_up(hub), 30, "the region's leaf link")
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    worker = await connect_bus(region.url, "region-worker", options=region_user("rollout-worker"))
    publisher = Publisher(admin.js)
    broadcaster = WeightBroadcaster(
        admin, publisher, tmp_path / "staging", signer=SIGNER, snapshot_every=3,
        options=EncodeOptions(max_chunk_bytes=64 << 10),
    )  # fmt: skip
    versions: dict[int, Any] = {}

    async def publish_until(version: int) -> None:
        from libs.weights.handoff import stage_weights

        for v in range(max(versions, default=0) + 1, version + 1):
            versions[v] = model_state(0) if v == 1 else next_version(versions[v - 1], v)
            await broadcaster.on_staged(
                await stage_weights(publisher, tmp_path / "staging", versions[v], v)
            )

    receiver = RegionalWeightReceiver(worker, trusting(fetch_parallel=4, decode_process=False))
    state: dict[str, Any] = {}
    try:
        await publish_until(2)
        await receive_until(receiver, state, 2, timeout_s=60)
        link.cut()
        await wait_for(lambda: not link_is_up(hub), 30, "the link down")
        await publish_until(8)  # snapshots 4 and 7: the hub keeps 7 and the delta 8
        first = (await admin.js.stream_info(streams.WEIGHTS_ANNOUNCE.name)).state.first_seq
        assert first > 1
        link.restore()
        taken: list[tuple[int, str]] = []
        while receiver.current is None or receiver.current.version != 8:
            update = await asyncio.wait_for(receiver.next_update(), 120)
            taken.append((update.version, update.kind))
            await asyncio.to_thread(receiver.apply, update, state)
        assert taken == [(7, "snapshot"), (8, "delta")], taken
        assert_bit_exact(state, versions[8])
        assert not violations(hub, region)
    finally:
        await receiver.close()
        await admin.close()
        await worker.close()


# --- the whole run ---------------------------------------------------------------------------


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as services:
        yield services


async def run_as(
    stack: AsyncExitStack, service: Service, url: str, options: NatsOptions
) -> asyncio.Task[None]:
    """Start `service` on its own connection as the given user; stopped with the stack."""
    bus = await connect_bus(url, name=service.name, options=options)
    stack.push_async_callback(bus.close)
    await service.start(bus)
    task = asyncio.create_task(service.run(), name=service.name)

    async def shut_down() -> None:
        if not task.done():
            await service.stop()
        await asyncio.wait_for(task, timeout=60)

    stack.push_async_callback(shut_down)
    return task


async def scored_rollouts(admin: Bus) -> list[Rollout]:
    """Every rollout the hub scored, in order."""
    name = streams.ROLLOUTS_SCORED.name
    info = await admin.js.stream_info(name)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await admin.js.get_msg(name, seq)
        found.append(wire.decode(ScoredRollout, raw.data or b"", dict(raw.headers or {})).rollout)
    return found


def trained_ids(run_dir: Path) -> list[str]:
    return [i for step in read_step_samples(run_dir) for i in step.sample_ids]


async def test_a_region_cut_off_for_60_s_keeps_rolling_out_and_the_hub_gets_every_rollout_once(
    cut_servers: tuple[NatsServer, NatsServer, LinkCutter],
    stack: AsyncExitStack,
    tmp_path: Path,
) -> None:
    hub, region, link = cut_servers
    run_dir = tmp_path / "run"
    hub_services: list[tuple[Service, str]] = [
        (
            # Far enough ahead that a slow trainer (a busy machine) still leaves tasks for the
            # region to buffer: with 8 batches ahead, finished rollouts waiting for the
            # trainer took all the room and the region's queue stayed empty.
            EnvGatewayService(
                EnvGatewaySettings(
                    group_size=4, feeder=FeederConfig(mode="async", max_ahead_versions=32)
                )
            ),
            "env-gateway",
        ),
        (RewardService(RewardSettings(fetch_timeout_s=0.2)), "reward"),
        (
            WeightBroadcasterService(
                WeightBroadcasterSettings(run_dir=run_dir, encode=EncodeOptions(threads=1))
            ),
            "weight-broadcaster",
        ),
        (
            TrainerService(
                TrainerSettings(
                    run_dir=run_dir,
                    policy=PolicyConfig(device="cpu"),
                    batch_groups=1,
                    # The outage's rollouts carry the version the region held at the cut, which
                    # on a busy machine lags the trainer's by more than 16: what is tested is
                    # that they arrive and are trained, so no bound of the run may drop them.
                    max_staleness=1000,
                    eval=EvalGateConfig(every_versions=0),
                    checkpoint_every_steps=1000,
                    same_host=SameHostShareConfig(enabled=False),
                )
            ),
            "trainer",
        ),
    ]
    for service, role in hub_services:
        await run_as(stack, service, hub.url, hub_user(role))
    # The region: its own gateway (tasks from the hub's queue, its envs) and worker, on the
    # regional server only.
    gateway = EnvGatewayService(
        EnvGatewaySettings(
            feeder=FeederConfig(mode="off"),
            intake=TaskIntakeConfig(hub_domain=HUB_DOMAIN, buffer_tasks=6, poll_interval_s=0.2),
        )
    )
    await run_as(stack, gateway, region.url, region_user("env-gateway"))
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="region-worker",
            policy=PolicyConfig(device="cpu", seed=9),  # not the trainer's: it must take its
            weights=trusting(),
            same_host=SameHostTakeConfig(enabled=False),
            max_batch_tasks=2,
            fetch_timeout_s=0.2,
            drain_timeout_s=30.0,
        )
    )
    worker_task = await run_as(stack, worker, region.url, region_user("rollout-worker"))
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    stack.push_async_callback(admin.close)
    relay = await connect_bus(region.url, "relay", options=region_user("relay"))
    stack.push_async_callback(relay.close)

    async def outbox_seq() -> int:
        return int((await relay.js.stream_info(ROLLOUTS_OUTBOX.name)).state.last_seq)

    async def buffered() -> bool:
        info = await relay.js.consumer_info(REGION_WORKER_TASKS.stream, REGION_WORKER_TASKS.durable)
        return int(info.num_pending or 0) >= 1

    # Running: the trainer learns from the region, and the region holds tasks in its buffer.
    await wait_for(lambda: len(read_steps(run_dir)) >= 2, 300, "2 steps on the region's rollouts")
    await wait_for(buffered, 120, "tasks buffered in the region")
    assert worker.regional and worker.engine_version is not None

    link.cut()
    cut_at, before = time.time(), await outbox_seq()
    await wait_for(lambda: not link_is_up(hub), 30, "the link down")

    async def made_more() -> bool:
        return await outbox_seq() > before

    await wait_for(made_more, OUTAGE_S * 3, "the region rolling out with the link down")
    await asyncio.sleep(max(0.0, cut_at + OUTAGE_S - time.time()))
    made_in_outage = await outbox_seq() - before
    restored_at = time.time()
    link.restore()
    assert not worker_task.done() and gateway.intake is not None
    assert gateway.intake.link_up is False  # it saw the hub gone, and kept serving episodes
    hub_ids = {r.rollout_id for r in await scored_rollouts(admin) if r.created_at > cut_at}
    assert not hub_ids, "the hub got rollouts through a cut link"

    def outage_made(rollouts: list[Rollout]) -> set[str]:
        return {r.rollout_id for r in rollouts if cut_at < r.created_at < restored_at}

    async def trained_outage_and_after() -> bool:
        rollouts = await scored_rollouts(admin)
        trained = set(trained_ids(run_dir))
        after = {r.rollout_id for r in rollouts if r.created_at > restored_at}
        return bool(outage_made(rollouts) & trained) and bool(after & trained)

    await wait_for(trained_outage_and_after, 300, "training on the outage's rollouts and after")
    # The region stops making rollouts; then all it made reaches the hub.
    await worker.stop()
    await asyncio.wait_for(worker_task, 60)
    made = (await relay.js.stream_info(ROLLOUTS_OUTBOX.name)).state.messages

    async def all_scored() -> bool:
        return len({r.rollout_id for r in await scored_rollouts(admin)}) >= made

    await wait_for(all_scored, 120, "every regional rollout scored on the hub")
    rollouts = await scored_rollouts(admin)
    counts = Counter(r.rollout_id for r in rollouts)
    assert len(counts) == made == worker.num_published
    assert max(counts.values()) == 1, [i for i, n in counts.items() if n > 1]
    assert {r.worker_id for r in rollouts} == {"region-worker"}
    assert made_in_outage > 0 and outage_made(rollouts)
    trained = Counter(trained_ids(run_dir))
    assert max(trained.values()) == 1  # none trained twice
    assert not violations(hub, region)
