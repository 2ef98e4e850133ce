"""rollout-worker on a real nats-server with a real env-gateway, weight-broadcaster and tiny
model: groups of rollouts with the right ids and tokens, no duplicates on redelivery, weights
swapped in place bit for bit, and the synchronous baseline's wait for a policy version."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.domains.arith.env import ArithmeticTasks
from libs.engine.hf import HFEngine
from libs.envs.feeder import FeederConfig
from libs.policy import PolicyConfig, build_policy
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from proto import streams
from proto.messages import EPISODE_STAT_TRUNCATED_TURNS, DeadLetter, Rollout, Task
from proto.subjects import task_subject
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import state_trainer_policy, wait_for

GROUP = 4
TASKS = ArithmeticTasks(difficulty=1, group_size=GROUP, seed=0)
TOKENIZER = ByteTokenizer()


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer would stage: the tiny policy's state dict (tied weights under both
    names), from another init than the worker's own so a swap visibly changes it."""
    model = build_policy(PolicyConfig(seed=seed))
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.int32)


class Cluster:
    """env-gateway, weight-broadcaster and a rollout worker, in-process on one bus."""

    def __init__(self, bus: Bus, staging_dir: Path) -> None:
        self.bus = bus
        self.staging_dir = staging_dir
        self.publisher = Publisher(bus.js)
        self.running: list[tuple[Service, asyncio.Task[None]]] = []
        self.worker: RolloutWorkerService | None = None
        self.staged: dict[int, dict[str, torch.Tensor]] = {}

    async def start(self, service: Service) -> None:
        await service.start(self.bus)
        self.running.append((service, asyncio.create_task(service.run())))

    async def start_all(self, **worker_settings: Any) -> RolloutWorkerService:
        await state_trainer_policy(self.bus.js)  # this harness stands in for the trainer
        await self.start(EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off"))))
        settings = WeightBroadcasterSettings(
            staging_dir=self.staging_dir, encode=EncodeOptions(threads=1)
        )
        await self.start(WeightBroadcasterService(settings))
        self.worker = RolloutWorkerService(
            RolloutWorkerSettings(
                worker_id="worker-test",
                max_batch_tasks=4,
                fetch_timeout_s=0.2,
                drain_timeout_s=5.0,
                policy=PolicyConfig(device="cpu"),
                **worker_settings,
            )
        )
        await self.start(self.worker)
        return self.worker

    async def stop_all(self) -> None:
        for service, task in reversed(self.running):
            await service.stop()
            await asyncio.wait_for(task, timeout=10)

    async def stage(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.staged[version] = state
        await stage_weights(self.publisher, self.staging_dir, state, version)

    async def publish_task(self, task: Task, msg_id: str | None = None) -> None:
        await self.publisher.publish(task_subject(task.env), task, msg_id or task.task_id)

    async def rollouts(self) -> list[Rollout]:
        """Every rollout on the raw stream, in stream order."""
        info = await self.bus.js.stream_info(streams.ROLLOUTS_RAW.name)
        if info.state.messages == 0:
            return []
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await self.bus.js.get_msg(streams.ROLLOUTS_RAW.name, seq)
            out.append(wire.decode(Rollout, raw.data or b"", dict(raw.headers or {})))
        return out

    def has_rollouts(self, count: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return len(await self.rollouts()) >= count

        return check

    def holds_version(self, version: int) -> Callable[[], bool]:
        def check() -> bool:
            follower = self.worker.follower if self.worker else None
            return follower is not None and follower.has_version(version)

        return check


@pytest.fixture
async def cluster(bus: Bus, tmp_path: Path) -> AsyncIterator[Cluster]:
    await provision(bus.js)
    c = Cluster(bus, tmp_path / "staging")
    yield c
    await c.stop_all()


def engine_state(worker: RolloutWorkerService) -> dict[str, torch.Tensor]:
    assert worker.engine is not None
    model = worker.engine.model  # type: ignore[attr-defined]
    return dict(model.state_dict())


async def test_waits_for_weights_then_rolls_out_a_group(cluster: Cluster) -> None:
    worker = await cluster.start_all()
    task = TASKS.task(0)
    await cluster.publish_task(task)
    # No weights yet: not ready, and the task stays on the bus.
    assert worker.health()["status"] == "waiting for weights"
    assert worker.health()["policy_version"] is None
    spec = streams.ROLLOUT_WORKER_TASKS
    info = await cluster.bus.js.consumer_info(spec.stream, spec.durable)
    assert (info.num_pending, info.num_ack_pending) == (1, 0)

    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.has_rollouts(GROUP), 20, "a group of rollouts")
    assert worker.health()["status"] == "ok" and worker.health()["policy_version"] == 0
    live = engine_state(worker)
    for name, tensor in cluster.staged[0].items():
        assert torch.equal(bits(live[name]), bits(tensor)), name

    rollouts = await cluster.rollouts()
    assert [r.rollout_id for r in rollouts] == [f"{task.task_id}.{i}" for i in range(GROUP)]
    for i, rollout in enumerate(rollouts):
        assert (rollout.task_id, rollout.group_id, rollout.sample_index) == (task.task_id,) * 2 + (
            i,
        )
        assert rollout.env == "arith" and rollout.worker_id == "worker-test"
        assert rollout.task == task and rollout.created_at > 0
        prompt, answer = rollout.turns
        assert (prompt.role, prompt.text, prompt.token_ids) == (
            "user",
            task.prompt,
            TOKENIZER.encode(task.prompt),
        )
        assert prompt.policy_version is None and prompt.logprobs == []
        assert answer.role == "assistant" and answer.policy_version == 0
        assert 1 <= len(answer.token_ids) <= int(task.spec["max_tokens"])
        assert len(answer.logprobs) == len(answer.token_ids)
        assert all(lp <= 0.0 for lp in answer.logprobs)
        assert answer.text == TOKENIZER.decode(answer.token_ids)
        # The env ended the one-turn episode; a turn max_tokens cut is counted, not the ending.
        ended_by_eos = answer.token_ids[-1] == TOKENIZER.eos_id
        assert (
            rollout.finish_reason == "stop" and rollout.env_info["expected"] == task.spec["answer"]
        )
        assert rollout.stats[EPISODE_STAT_TRUNCATED_TURNS] == (0 if ended_by_eos else 1)

    # A redelivered task (here: the same task stored again) rolls out under the same ids,
    # which the raw stream drops as duplicates.
    await cluster.publish_task(task, msg_id=f"{task.task_id}-again")
    assert worker.consumer is not None
    await wait_for(lambda: worker.consumer is not None and worker.consumer.num_handled == 2, 20)
    assert len(await cluster.rollouts()) == GROUP
    assert worker.health()["rollouts_published"] == GROUP


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "via-shadow"])
async def test_a_new_version_is_swapped_in_place_and_later_rollouts_carry_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    if not in_place:  # as on a GPU: a CPU shadow takes the version, then update_weights
        monkeypatch.setattr(HFEngine, "live_tensors", lambda self: None)
    worker = await cluster.start_all()
    assert worker.follower is not None and worker.follower.in_place == in_place
    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.holds_version(0), 20, "version 0")
    await cluster.publish_task(TASKS.task(0))
    await wait_for(cluster.has_rollouts(GROUP), 20, "rollouts at version 0")
    storage = {name: t.data_ptr() for name, t in engine_state(worker).items()}

    # Version 1: a few tensors change, as after an optimizer step (a delta on the wire).
    v1 = {name: t.clone() for name, t in cluster.staged[0].items()}
    v1["model.layers.0.mlp.up_proj.weight"] += 0.01
    v1["model.norm.weight"][:7] = -0.0
    await cluster.stage(1, v1)
    await wait_for(cluster.holds_version(1), 20, "version 1 swapped in")

    live = engine_state(worker)
    assert {name: t.data_ptr() for name, t in live.items()} == storage
    for name, tensor in v1.items():
        assert torch.equal(bits(live[name]), bits(tensor)), name
    health = worker.health()
    assert health["policy_version"] == 1 and health["weight_swaps"] == 2
    assert health["weight_swap_failures"] == 0
    assert health["last_swap_pause_s"] is not None and health["last_swap_pause_s"] >= 0

    await cluster.publish_task(TASKS.task(1))
    await wait_for(cluster.has_rollouts(2 * GROUP), 20, "rollouts at version 1")
    later = [r for r in await cluster.rollouts() if r.task_id == TASKS.task(1).task_id]
    assert len(later) == GROUP and all(r.turns[1].policy_version == 1 for r in later)


async def test_a_task_waits_for_its_min_policy_version(cluster: Cluster) -> None:
    worker = await cluster.start_all()
    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.holds_version(0), 20, "version 0")

    synced = TASKS.task(5)
    synced.min_policy_version = 1
    await cluster.publish_task(synced)
    await wait_for(lambda: worker.health()["tasks_waiting_for_version"] == 1, 10, "the wait")
    assert await cluster.rollouts() == []

    await cluster.stage(1, trainer_weights(seed=11))
    await wait_for(cluster.has_rollouts(GROUP), 20, "rollouts at version 1")
    rollouts = await cluster.rollouts()
    assert {r.turns[1].policy_version for r in rollouts} == {1}
    assert worker.health()["tasks_waiting_for_version"] == 0


async def test_a_version_that_never_comes_holds_no_slot_and_its_task_is_dead_lettered(
    cluster: Cluster,
) -> None:
    worker = await cluster.start_all(min_version_wait_s=0.2)
    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.holds_version(0), 20, "version 0")
    unreachable = TASKS.task(6)
    unreachable.min_policy_version = 10**6
    await cluster.publish_task(unreachable)

    async def dead_lettered() -> bool:
        info = await cluster.bus.js.stream_info(streams.DEAD_LETTERS.name)
        return info.state.messages == 1

    # Five attempts, each giving the slot back after 0.2 s, with naks of 0.5 to 15 s between.
    await wait_for(dead_lettered, 60, "the task dead-lettered")
    raw = await cluster.bus.js.get_msg(streams.DEAD_LETTERS.name, seq=1)
    letter = wire.decode(DeadLetter, raw.data or b"", None)
    assert letter.reason == "max_deliver"
    assert "no weights of version >= 1000000" in letter.error
    assert worker.health()["tasks_in_progress"] == 0


async def test_concurrent_tasks_share_generate_calls(cluster: Cluster) -> None:
    worker = await cluster.start_all()
    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.holds_version(0), 20, "version 0")
    tasks = [TASKS.task(i) for i in range(8)]
    await asyncio.gather(*(cluster.publish_task(task) for task in tasks))
    await wait_for(cluster.has_rollouts(8 * GROUP), 30, "8 groups")

    rollouts = await cluster.rollouts()
    assert sorted(r.rollout_id for r in rollouts) == sorted(
        f"{t.task_id}.{i}" for t in tasks for i in range(GROUP)
    )
    assert worker.batcher is not None
    assert worker.batcher.largest_batch >= 2  # several tasks decoded in one engine call
    assert worker.batcher.num_calls < len(tasks)
    health = worker.health()
    assert health["tokens_per_s"] > 0 and 0 < health["busy_fraction"] <= 1


async def test_a_version_that_does_not_fit_is_never_written(cluster: Cluster) -> None:
    worker = await cluster.start_all()
    await cluster.stage(0, trainer_weights(seed=10))
    await wait_for(cluster.holds_version(0), 20, "version 0")
    before = {name: t.clone() for name, t in engine_state(worker).items()}

    # Another architecture's version: a tensor the worker's model does not have.
    bad = {name: t + 1 for name, t in cluster.staged[0].items()}
    bad["model.layers.9.extra.weight"] = torch.ones(4)
    await cluster.stage(1, bad)
    assert worker.follower is not None
    await wait_for(lambda: worker.health()["weight_swap_failures"] >= 1, 20, "the refusal")
    assert worker.health()["policy_version"] == 0 and worker.health()["status"] == "ok"
    live = engine_state(worker)
    for name, tensor in before.items():
        assert torch.equal(bits(live[name]), bits(tensor)), name

    await cluster.publish_task(TASKS.task(2))  # still rolling out, with version 0
    await wait_for(cluster.has_rollouts(GROUP), 20, "rollouts at version 0")
    assert {r.turns[1].policy_version for r in await cluster.rollouts()} == {0}


async def test_the_context_budget_is_capped_at_the_models_positions(bus: Bus) -> None:
    await provision(bus.js)
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="budget", policy=PolicyConfig(device="cpu"), context_budget_tokens=1_000_000
        )
    )
    await worker.start(bus)
    try:
        assert worker.engine is not None and worker.runner is not None
        limit = worker.engine.max_context_tokens
        assert limit is not None and worker.runner.agent.context_budget_tokens == limit
    finally:
        await worker.stop()
