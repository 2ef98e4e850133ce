"""env-gateway on a real nats-server: episodes over request/reply with typed errors, and the
task feeder in its async (queue depth) and sync (one batch per policy version) modes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.domains import registry
from libs.domains.arith.env import ArithmeticTasks
from libs.domains.arith.rubric import arith_rubric
from libs.domains.domain import Domain
from libs.envs.base import Environment, Episode, Opening, StepResult
from libs.envs.client import EnvClient, EnvError
from libs.envs.feeder import FeederConfig
from libs.envs.server import ServerLimits
from proto import messages as m
from proto import streams
from proto.messages import Task, ToolCall
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from tests.conftest import wait_for

TASK = ArithmeticTasks(difficulty=1, group_size=4, seed=0).task(0)


class ToolEpisode(Episode):
    """Multi-turn: "ok" continues, "end" finishes, "boom" raises, "hang" never returns."""

    closed: ClassVar[list[str]] = []

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.turns = 0

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        self.turns += 1
        if action == "boom":
            raise RuntimeError("the tool crashed")
        if action == "hang":
            await asyncio.Event().wait()
        return StepResult(observation=f"turn {self.turns}", done=action == "end")

    async def close(self) -> None:
        ToolEpisode.closed.append(self.task_id)


class ToolEnv(Environment):
    name: ClassVar[str] = "test-tool"

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        return ToolEpisode(task.task_id), Opening(observation="hello", max_tokens=5, stop=("\n",))


def tool_task(task_id: str) -> Task:
    return Task(task_id=task_id, env="test-tool", prompt="hello")


@pytest.fixture
async def start_gateway(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., object]]:
    """Starts gateways in-process (settings as keyword arguments, the feeder's as a dict);
    stops them all after."""
    tool_domain = Domain(ToolEnv.name, Path(__file__).parent, env=ToolEnv, rubric=arith_rubric)
    monkeypatch.setitem(registry._REGISTERED, ToolEnv.name, tool_domain)
    await provision(bus.js)
    running: list[tuple[EnvGatewayService, asyncio.Task[None]]] = []

    async def start(
        feeder: dict[str, object] | None = None, **overrides: object
    ) -> EnvGatewayService:
        config = FeederConfig.model_validate(
            {"mode": "off", "poll_interval_s": 0.05, **(feeder or {})}
        )
        service = EnvGatewayService(EnvGatewaySettings(feeder=config, **overrides))  # type: ignore[arg-type]
        await service.start(bus)
        running.append((service, asyncio.create_task(service.run())))
        return service

    yield start
    for service, task in running:
        await service.stop()
        await asyncio.wait_for(task, timeout=10)


async def test_an_arith_episode_over_request_reply(bus: Bus, start_gateway: Callable) -> None:
    gateway: EnvGatewayService = await start_gateway()
    client = EnvClient(bus.nc)

    opening = await client.reset(TASK, episode_id="ep-1")
    assert opening.observation == TASK.prompt
    assert opening.max_tokens == len(TASK.spec["answer"]) + 1 and opening.stop == []
    assert gateway.server is not None and gateway.server.instance_id in opening.step_subject
    assert gateway.health()["episodes_open"] == 1
    again = await client.reset(TASK, episode_id="ep-1")  # a retried reset: same episode
    assert again.observation == opening.observation and gateway.health()["episodes_open"] == 1

    reply = await client.step("ep-1", "arith", TASK.spec["answer"])
    assert reply.done and reply.info == {"answer_correct": True, "expected": TASK.spec["answer"]}
    assert gateway.health()["episodes_open"] == 0 and client.num_open == 0
    assert await client.close("ep-1", "arith") is False  # already done: harmless


async def test_a_multi_turn_episode_and_its_close(bus: Bus, start_gateway: Callable) -> None:
    gateway: EnvGatewayService = await start_gateway()
    client = EnvClient(bus.nc)
    opening = await client.reset(tool_task("multi"), episode_id="ep-multi")
    assert (opening.observation, opening.max_tokens, opening.stop) == ("hello", 5, ["\n"])
    first = await client.step("ep-multi", "test-tool", "ok")
    second = await client.step("ep-multi", "test-tool", "ok")
    assert (first.observation, first.done, second.observation) == ("turn 1", False, "turn 2")
    assert await client.close("ep-multi", "test-tool") is True
    assert "multi" in ToolEpisode.closed and gateway.health()["episodes_open"] == 0


async def test_errors_are_typed_replies_and_the_gateway_keeps_serving(
    bus: Bus, start_gateway: Callable
) -> None:
    gateway: EnvGatewayService = await start_gateway(limits=ServerLimits(step_timeout_s=0.3))
    client = EnvClient(bus.nc)

    async def kind_of(call: object) -> str:
        with pytest.raises(EnvError) as caught:
            await call  # type: ignore[misc]
        return caught.value.kind

    assert await kind_of(client.step("never-opened", "arith", "1")) == m.ENV_ERROR_UNKNOWN_EPISODE
    chess = Task(task_id="c1", env="chess", prompt="e4")
    assert await kind_of(client.reset(chess, timeout_s=2)) == m.ENV_ERROR_UNKNOWN_ENV
    no_answer = Task(task_id="bad", env="arith", prompt="1=", spec={})
    assert await kind_of(client.reset(no_answer)) == m.ENV_ERROR_BAD_REQUEST

    await client.reset(tool_task("crash"), episode_id="ep-crash")
    assert await kind_of(client.step("ep-crash", "test-tool", "boom")) == m.ENV_ERROR_ENV_CRASHED
    await client.reset(tool_task("hang"), episode_id="ep-hang")
    assert await kind_of(client.step("ep-hang", "test-tool", "hang")) == m.ENV_ERROR_TIMEOUT
    # Both episodes ended cleanly: forgotten and closed.
    assert await kind_of(client.step("ep-crash", "test-tool", "ok")) == m.ENV_ERROR_UNKNOWN_EPISODE
    assert {"crash", "hang"} <= set(ToolEpisode.closed)

    garbage = await bus.nc.request("rl.env.arith.step", b"\xc1", timeout=2)
    reply = wire.decode(m.EnvStepReply, garbage.data, dict(garbage.headers or {}))
    assert reply.error == m.ENV_ERROR_BAD_REQUEST

    await client.reset(TASK, episode_id="ep-after")  # still serving
    assert (await client.step("ep-after", "arith", "x")).info["answer_correct"] is False
    assert gateway.health()["episodes_open"] == 0


async def test_expired_episodes_are_closed(bus: Bus, start_gateway: Callable) -> None:
    gateway: EnvGatewayService = await start_gateway()
    client = EnvClient(bus.nc)
    opening = await client.reset(tool_task("old"), episode_id="ep-old")
    assert opening.deadline > time.time()
    assert gateway.server is not None
    assert await gateway.server.close_expired(now=opening.deadline + 1) == 1
    assert "old" in ToolEpisode.closed
    with pytest.raises(EnvError) as caught:
        await client.step("ep-old", "test-tool", "ok")
    assert caught.value.kind == m.ENV_ERROR_UNKNOWN_EPISODE


async def worker_queue(bus: Bus) -> tuple[int, int]:
    spec = streams.ROLLOUT_WORKER_TASKS
    info = await bus.js.consumer_info(spec.stream, spec.durable)
    return int(info.num_pending), int(info.num_ack_pending)


async def stored_tasks(bus: Bus) -> list[Task]:
    info = await bus.js.stream_info(streams.TASKS.name)
    tasks = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(streams.TASKS.name, seq)
        tasks.append(wire.decode(Task, raw.data or b"", dict(raw.headers or {})))
    return tasks


async def drain_tasks(bus: Bus, count: int) -> list[Task]:
    """Take `count` tasks as a worker would and ack them: the feeder tops the queue up."""
    sub = await bus.js.pull_subscribe_bind(
        durable=streams.ROLLOUT_WORKER_TASKS.durable, stream=streams.TASKS.name
    )
    taken = []
    for msg in await sub.fetch(count, timeout=2):
        taken.append(wire.decode(Task, msg.data, dict(msg.headers or {})))
        await msg.ack()
    await sub.unsubscribe()
    return taken


async def test_async_feeder_keeps_the_queue_at_depth(bus: Bus, start_gateway: Callable) -> None:
    kv = await bus.js.key_value(streams.STATE.bucket)
    await kv.put(streams.BATCH_GROUPS_KEY, b"16")  # a trainer's batch: far more than the depth
    gateway: EnvGatewayService = await start_gateway(
        feeder={"mode": "async", "queue_depth_tasks": 5}
    )
    assert gateway.feeder is not None

    async def queue_is(pending: int, acking: int) -> bool:
        return await worker_queue(bus) == (pending, acking)

    await wait_for(lambda: queue_is(5, 0), what="5 queued tasks")
    queued = await stored_tasks(bus)
    assert [t.task_id for t in queued] == [f"arith-d0-s0-{i}" for i in range(5)]
    assert queued[0].prompt == ArithmeticTasks(difficulty=0, group_size=8, seed=0).task(0).prompt

    sub = await bus.js.pull_subscribe_bind(
        durable=streams.ROLLOUT_WORKER_TASKS.durable, stream=streams.TASKS.name
    )
    taken = await sub.fetch(3, timeout=2)
    # Tasks a worker holds count toward the depth: nothing more is published for them.
    assert await gateway.feeder.feed_once() == 0
    for msg in taken:
        await msg.ack()
    await wait_for(lambda: queue_is(5, 0), what="the queue topped up again")
    assert gateway.feeder.num_published == 8
    assert await gateway.feeder.feed_once() == 0
    assert gateway.health()["tasks_published"] == 8
    await sub.unsubscribe()


async def test_sync_feeder_publishes_one_tagged_batch_per_version(
    bus: Bus, start_gateway: Callable
) -> None:
    kv = await bus.js.key_value(streams.STATE.bucket)
    gateway: EnvGatewayService = await start_gateway(feeder={"mode": "sync"})
    # Before the trainer wrote its batch size, the feeder has no batch to publish.
    assert gateway.feeder is not None and await gateway.feeder.feed_once() == 0
    await kv.put(streams.BATCH_GROUPS_KEY, b"3")  # the trainer's batch_groups

    async def published(n: int) -> bool:
        return gateway.feeder is not None and gateway.feeder.num_published == n

    await wait_for(lambda: published(3), what="the batch for version 0")
    await kv.put("policy_version", b"1")
    await wait_for(lambda: published(6), what="the batch for version 1")
    await kv.put("policy_version", b"1")  # the same version again: no new batch
    assert gateway.feeder is not None and await gateway.feeder.feed_once() == 0
    await kv.put("policy_version", b"3")
    await wait_for(lambda: published(9), what="the batch for version 3")

    tasks = await stored_tasks(bus)
    assert [t.min_policy_version for t in tasks] == [0, 0, 0, 1, 1, 1, 3, 3, 3]
    assert len({t.task_id for t in tasks}) == 9

    # A restarted gateway resumes where the last one stopped: no repeat, no extra batch.
    await gateway.stop()
    again: EnvGatewayService = await start_gateway(feeder={"mode": "sync"})
    assert again.feeder is not None
    assert (again.feeder.state.next_index, again.feeder.state.fed_version) == (9, 3)
    assert await again.feeder.feed_once() == 0
    await kv.put("policy_version", b"4")
    await wait_for(lambda: again.feeder is not None and again.feeder.num_published == 3)
    assert [t.task_id for t in (await stored_tasks(bus))[9:]] == [
        f"arith-d0-s0-{i}" for i in (9, 10, 11)
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_feeder_feeds_as_soon_as_the_trainer_writes_its_progress(
    bus: Bus, start_gateway: Callable, mode: str
) -> None:
    kv = await bus.js.key_value(streams.STATE.bucket)
    # A poll interval no test outlives: every round after the first is one that the
    # trainer's writes start.
    gateway: EnvGatewayService = await start_gateway(
        feeder={"mode": mode, "poll_interval_s": 3600, "max_ahead_versions": 1}
    )
    feeder = gateway.feeder
    assert feeder is not None

    async def published(n: int) -> bool:
        return feeder.num_published == n

    await kv.put(streams.BATCH_GROUPS_KEY, b"2")  # the trainer starts: its batch size
    # sync: version 0's batch; async: the batch in progress and one ahead.
    await wait_for(lambda: published(2 if mode == "sync" else 4), what="the first tasks")
    if mode == "sync":
        await kv.put(streams.POLICY_VERSION_KEY, b"1")  # a step: the next version
        await wait_for(lambda: published(4), what="the batch for version 1")
    else:
        await kv.put(streams.GROUPS_TAKEN_KEY, b"2")  # a step: one batch taken
        await wait_for(lambda: published(6), what="a batch for the next step")


async def test_async_feeder_stays_a_bounded_number_of_batches_ahead_of_the_trainer(
    bus: Bus, start_gateway: Callable
) -> None:
    kv = await bus.js.key_value(streams.STATE.bucket)
    await kv.put(streams.BATCH_GROUPS_KEY, b"2")  # the trainer's batch_groups
    gateway: EnvGatewayService = await start_gateway(
        feeder={"mode": "async", "queue_depth_tasks": 100, "max_ahead_versions": 1}
    )
    assert gateway.feeder is not None
    # The trainer's batch in progress plus one batch ahead: 2 * 2 tasks, however deep the queue.
    await wait_for(lambda: gateway.feeder is not None and gateway.feeder.num_published == 4)
    assert await gateway.feeder.feed_once() == 0
    await kv.put("trainer_groups_taken", b"2")  # one batch taken (trained or dropped)
    await wait_for(lambda: gateway.feeder is not None and gateway.feeder.num_published == 6)
    assert await gateway.feeder.feed_once() == 0


async def test_async_feeder_tags_tasks_with_the_oldest_version_the_trainer_can_still_use(
    bus: Bus, start_gateway: Callable
) -> None:
    # Before the trainer wrote its bound, tasks ask for no version.
    gateway: EnvGatewayService = await start_gateway(
        feeder={"mode": "async", "queue_depth_tasks": 2, "max_ahead_versions": None}
    )
    kv = await bus.js.key_value(streams.STATE.bucket)
    await wait_for(lambda: gateway.feeder is not None and gateway.feeder.num_published == 2)
    # Trainer at version 11, bound 8: samples of weights older than 3 could only be dropped.
    await kv.put(streams.POLICY_VERSION_KEY, b"11")
    await kv.put(streams.MAX_STALENESS_KEY, b"8")
    tasks = await drain_tasks(bus, 2)
    await wait_for(lambda: gateway.feeder is not None and gateway.feeder.num_published == 4)
    # The bound 0 of the synchronous baseline: only the trainer's own version.
    await kv.put(streams.MAX_STALENESS_KEY, b"0")
    tasks += await drain_tasks(bus, 2)
    await wait_for(lambda: gateway.feeder is not None and gateway.feeder.num_published == 6)
    tasks += await drain_tasks(bus, 2)
    assert [t.min_policy_version for t in tasks] == [0, 0, 3, 3, 11, 11]


async def test_a_paced_feeder_runs_further_ahead_only_while_workers_could_take_more(
    bus: Bus, start_gateway: Callable
) -> None:
    """min 1, max 3 batches ahead: nothing finished and no task waiting for a worker (all
    held, as episodes waiting on slow tools) -> one batch further per trainer step, up to 3;
    a batch of tasks waiting for a worker -> one batch less."""
    kv = await bus.js.key_value(streams.STATE.bucket)
    await kv.put(streams.BATCH_GROUPS_KEY, b"2")
    gateway: EnvGatewayService = await start_gateway(
        feeder={"mode": "async", "queue_depth_tasks": 100, "min_ahead_versions": 1,
                "max_ahead_versions": 3}
    )  # fmt: skip
    feeder = gateway.feeder
    assert feeder is not None
    await wait_for(lambda: feeder.num_published == 4, what="the batch and one ahead")
    sub = await bus.js.pull_subscribe_bind(
        durable=streams.ROLLOUT_WORKER_TASKS.durable, stream=streams.TASKS.name
    )
    held = await sub.fetch(4, timeout=2)  # a worker holds them all, none finished
    await kv.put(streams.GROUPS_TAKEN_KEY, b"2")  # a step's groups (dropped as stale, say)
    await wait_for(lambda: feeder.ahead == 2, what="one batch further")
    await wait_for(lambda: feeder.num_published == 2 + 3 * 2, what="two batches ahead")
    held += await sub.fetch(4, timeout=2)
    await kv.put(streams.GROUPS_TAKEN_KEY, b"4")
    await wait_for(lambda: feeder.ahead == 3, what="the most ahead")
    await kv.put(streams.GROUPS_TAKEN_KEY, b"6")  # tasks now wait for a worker
    await wait_for(lambda: feeder.ahead == 2, what="one batch less")
    for msg in held:
        await msg.ack()
    await sub.unsubscribe()
