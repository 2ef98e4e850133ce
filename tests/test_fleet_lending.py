"""A serve replica lent to RL and recalled, on a real nats-server with a real env-gateway,
weight-broadcaster and tiny model: it leaves readiness and refuses product requests, rolls
out tasks with the trainer's newest version, and comes back to its promoted version bit for
bit; a recall hands the tasks it cannot finish back to the queue, never losing one.

Run: .venv/bin/python -m pytest tests/test_fleet_lending.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.domains.arith.env import ArithmeticTasks
from libs.envs.feeder import FeederConfig
from libs.fleet.config import LendingConfig
from libs.fleet.ledger import new_command, read_statuses, send_command
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout.weights_follower import WeightsFollower
from libs.serve.config import ServeConfig
from libs.service import Service
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from proto import streams
from proto.fleet import FleetAction, FleetCommandReply
from proto.messages import Rollout, Task
from proto.subjects import task_subject
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import state_trainer_policy, wait_for
from tests.fleet_support import announced_hash
from tests.signing_support import trusting

TASKS = ArithmeticTasks(difficulty=1, group_size=2, seed=0)
REPLICA = "replica-1"
PROBE = {"prompt": "1+1=", "max_tokens": 2}


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A trainer's staged state: the tiny policy from another init."""
    return {n: t.clone() for n, t in build_policy(PolicyConfig(seed=seed)).state_dict().items()}


def same_bits(live: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(live[n].contiguous().view(torch.uint8).flatten(),
                           t.contiguous().view(torch.uint8).flatten())
               for n, t in state.items())  # fmt: skip


class Fleet:
    """env-gateway, weight-broadcaster and one lendable serve replica, in-process."""

    def __init__(self, bus: Bus, staging_dir: Path) -> None:
        self.bus = bus
        self.staging_dir = staging_dir
        self.publisher = Publisher(bus.js)
        self.running: list[tuple[Service, asyncio.Task[None]]] = []
        self.serve_url = ""

    async def start(self, lending: LendingConfig) -> RolloutWorkerService:
        await state_trainer_policy(self.bus.js)  # the test stands in for the trainer
        gateway = EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off")))
        broadcaster = WeightBroadcasterService(
            WeightBroadcasterSettings(staging_dir=self.staging_dir, encode=EncodeOptions(threads=1))
        )
        port = free_port()
        self.serve_url = f"http://127.0.0.1:{port}"
        replica = RolloutWorkerService(
            RolloutWorkerSettings(
                worker_id=REPLICA,
                policy=PolicyConfig(device="cpu", seed=5),
                consume_tasks=False,
                serve=ServeConfig(port=port),
                weights=trusting(promoted_only=True, decode_process=False),
                lending=lending,
                max_batch_tasks=2,
                fetch_timeout_s=0.2,
                drain_timeout_s=5.0,
            )
        )
        for service in (gateway, broadcaster, replica):
            await service.start(self.bus)
            self.running.append((service, asyncio.create_task(service.run())))
        return replica

    async def stop(self) -> None:
        for service, task in reversed(self.running):
            await service.stop()
            await asyncio.wait_for(task, timeout=30)

    async def stage(self, version: int, state: dict[str, torch.Tensor]) -> None:
        await stage_weights(self.publisher, self.staging_dir, state, version)

    async def promote(self, version: int) -> None:
        kv = await self.bus.js.key_value(streams.STATE.bucket)
        await kv.put(streams.PROMOTED_VERSION_KEY, str(version).encode())

    async def command(self, action: FleetAction) -> FleetCommandReply:
        reply = await send_command(self.bus.nc, new_command(REPLICA, action, "test", "operator"))
        assert reply is not None and reply.accepted, reply
        return reply

    async def publish_task(self, task: Task) -> None:
        await self.publisher.publish(task_subject(task.env), task, task.task_id)

    async def rollouts(self) -> list[Rollout]:
        info = await self.bus.js.stream_info(streams.ROLLOUTS_RAW.name)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await self.bus.js.get_msg(streams.ROLLOUTS_RAW.name, seq)
            found.append(wire.decode(Rollout, raw.data or b"", dict(raw.headers or {})))
        return found if info.state.messages else []

    async def probe(self) -> int:
        async with httpx.AsyncClient(base_url=self.serve_url, timeout=30) as http:
            return (await http.post("/v1/completions", json=PROBE)).status_code


@pytest.fixture
async def fleet(bus: Bus, tmp_path: Path) -> AsyncIterator[Fleet]:
    await provision(bus.js)
    f = Fleet(bus, tmp_path / "staging")
    yield f
    await f.stop()


def live_weights(replica: RolloutWorkerService) -> dict[str, torch.Tensor]:
    assert replica.engine is not None
    live = replica.engine.live_tensors()
    assert live is not None
    return live


async def serving_promoted(fleet: Fleet, replica: RolloutWorkerService) -> dict[str, torch.Tensor]:
    """Stage and promote version 0, then two trainer versions past it; the replica serves 0."""
    promoted = weights(seed=10)
    await fleet.stage(0, promoted)
    await fleet.promote(0)
    await wait_for(replica.ready, 60, "the replica serving version 0")
    await fleet.stage(1, weights(seed=11))
    await fleet.stage(2, weights(seed=12))
    return promoted


async def test_a_lent_replica_rolls_out_the_trainers_version_and_comes_back_bit_for_bit(
    fleet: Fleet,
) -> None:
    replica = await fleet.start(LendingConfig(enabled=True, unready_grace_s=0.0))
    promoted = await serving_promoted(fleet, replica)
    assert await fleet.probe() == 200
    assert replica.lending is not None

    await fleet.command("lend")
    await wait_for(lambda: replica.lending is not None and replica.lending.role == "lent", 60)
    # Out of the load balancer; product requests are refused, not served with RL weights.
    assert not replica.ready() and await fleet.probe() == 503
    await wait_for(lambda: replica.engine_version == 2, 60, "the trainer's newest version")
    await fleet.publish_task(TASKS.task(0))
    await wait_for(lambda: replica.lending is not None and replica.lending.num_tasks_done
                   + (replica.lending.loan.num_tasks_done if replica.lending.loan else 0) >= 1,
                   60, "a task rolled out while lent")  # fmt: skip
    rollouts = await fleet.rollouts()
    assert {r.worker_id for r in rollouts} == {REPLICA}
    turns = [t for r in rollouts for t in r.turns if t.role == "assistant"]
    assert {t.policy_version for t in turns} == {2}
    assert {t.policy_version_hash for t in turns} == {await announced_hash(fleet.bus, 2)}

    await fleet.command("recall")
    await wait_for(replica.ready, 60, "ready again")
    assert replica.lending.role == "serving" and replica.engine_version == 0
    assert same_bits(live_weights(replica), promoted)
    record = replica.lending.last_recall
    assert record is not None and record.hash_matches and record.restored_version == 0
    assert await fleet.probe() == 200
    # Its health weighs it against the promoted version, not the trainer's newer ones.
    assert isinstance(replica.follower, WeightsFollower)
    assert await replica.follower.newest_available() == 0
    # The ledger says so too.
    await replica.lending.heartbeat()
    (status,) = await read_statuses(fleet.bus.js)
    assert (status.role, status.ready, status.policy_version) == ("serving", True, 0)
    assert (status.num_lends, status.num_recalls, status.tasks_done_lent) == (1, 1, 1)


async def test_a_recall_requeues_the_tasks_it_cannot_finish_and_loses_none(fleet: Fleet) -> None:
    replica = await fleet.start(LendingConfig(enabled=True, unready_grace_s=0.0,
                                              recall_grace_s=0.0))  # fmt: skip
    promoted = await serving_promoted(fleet, replica)
    await fleet.command("lend")
    await wait_for(lambda: replica.lending is not None and replica.lending.role == "lent", 60)
    # A task for a version that never comes stays in flight until the recall.
    waiting = Task(task_id="waits", env="arith", prompt="1+1=", spec=TASKS.task(1).spec,
                   min_policy_version=99)  # fmt: skip
    await fleet.publish_task(waiting)
    loan = replica.lending.loan
    await wait_for(lambda: loan is not None and "waits" in loan.in_flight, 60, "in flight")

    await fleet.command("recall")
    await wait_for(replica.ready, 60, "ready again")
    record = replica.lending.last_recall
    assert record is not None and record.requeued_task_ids == ["waits"]
    assert (record.tasks_in_flight, record.tasks_finished, record.episodes_requeued) == (1, 0, 1)
    assert same_bits(live_weights(replica), promoted) and record.hash_matches
    # Back on the work queue, not dead-lettered: the next worker takes it.
    info = await fleet.bus.js.stream_info(streams.TASKS.name)
    assert info.state.messages == 1
    dead = await fleet.bus.js.stream_info(streams.DEAD_LETTERS.name)
    assert dead.state.messages == 0


async def test_a_recall_while_draining_turns_the_replica_ready_again_untouched(
    fleet: Fleet,
) -> None:
    replica = await fleet.start(LendingConfig(enabled=True, unready_grace_s=600.0))
    promoted = await serving_promoted(fleet, replica)
    await fleet.command("lend")
    await wait_for(lambda: replica.lending is not None and replica.lending.role == "draining", 60)
    # Out of the load balancer, and still answering what it sent before it noticed.
    assert not replica.ready() and await fleet.probe() == 200
    await fleet.command("recall")
    await wait_for(replica.ready, 60, "ready again")
    assert replica.lending is not None and replica.lending.loan is None
    assert (replica.lending.num_lends, replica.lending.num_recalls) == (0, 1)
    assert replica.lending.last_recall is None  # no loan began: nothing was restored
    assert replica.engine_version == 0 and same_bits(live_weights(replica), promoted)
    assert await fleet.probe() == 200
