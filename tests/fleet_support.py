"""A serving fleet for tests: the trainer, weight-broadcaster, env-gateway and reward, three
lendable serve replicas behind a load balancer that honours readiness, and the capacity
controller, all in this process on one real nats-server, over real HTTP.

    async with serving_fleet(bus, tmp_path, controller=...) as fleet:
        load = ProductLoad(fleet.balancer, rate_rps=0.5)
        ...
        fleet.lent()            # ids of the replicas lent now

The trainer's eval gate promotes its first version only (every_versions is far off), so the
version the replicas serve, and restore after a loan, is version 0 throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.envs.feeder import FeederConfig
from libs.fleet.balancer import Answer, Backend, ReadyBalancer
from libs.fleet.config import ControllerConfig, LendingConfig
from libs.health_server import HealthServer
from libs.nats_server import free_port
from libs.policy import PolicyConfig
from libs.serve.config import ServeConfig
from libs.service import Service
from libs.trainer.eval_gate import EvalGateConfig
from libs.weights.encoder import EncodeOptions
from libs.weights.same_host import SameHostShareConfig, SameHostTakeConfig
from proto import streams
from proto.messages import ScoredRollout, Task, WeightAnnouncement
from services.capacity_controller.service import CapacityControllerService
from services.capacity_controller.settings import CapacityControllerSettings
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
from tests.signing_support import trusting

PROMPT = {"prompt": "Say 12+30=", "max_tokens": 4, "temperature": 0.0}


@dataclass
class Fleet:
    bus: Bus
    run_dir: Path
    trainer: TrainerService
    replicas: list[RolloutWorkerService]
    controller: CapacityControllerService
    balancer: ReadyBalancer

    def roles(self) -> dict[str, str]:
        return {r.settings.worker_id: r.lending.role if r.lending else "" for r in self.replicas}

    def lent(self) -> set[str]:
        return {name for name, role in self.roles().items() if role == "lent"}

    def serving(self) -> set[str]:
        return {r.settings.worker_id for r in self.replicas if r.ready()}


@dataclass
class ProductLoad:
    """Product requests at `rate_rps` (changed at will) through the balancer."""

    balancer: ReadyBalancer
    rate_rps: float
    answers: list[Answer] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # monotonic, one per answer
    _open: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        while True:
            task = asyncio.create_task(self._one())
            self._open.add(task)
            task.add_done_callback(self._open.discard)
            await asyncio.sleep(1.0 / self.rate_rps)

    async def _one(self) -> None:
        sent_at = time.monotonic()
        self.answers.append(await self.balancer.post("/v1/completions", PROMPT))
        self.sent_at.append(sent_at)

    async def drain(self, hang_s: float = 300.0) -> None:
        """Wait for the requests still open. A hang guard, not a speed bound: one CI run
        (2026-11-29) hung here until pytest's 600 s timeout with nothing said, so after
        `hang_s` this fails naming the backends that still hold requests."""
        if not self._open:
            return
        _, unanswered = await asyncio.wait(set(self._open), timeout=hang_s)
        holding = {
            backend.serve_url: {"open": backend.open_requests, "ready": backend.ready}
            for backend in self.balancer.backends
            if backend.open_requests
        }
        assert not unanswered, f"{len(unanswered)} product requests unanswered: {holding}"

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]


async def start(stack: contextlib.AsyncExitStack, service: Service, bus: Bus) -> None:
    """Start `service` and run it until the stack closes (then stop it and wait for it)."""
    await service.start(bus)
    task = asyncio.create_task(service.run(), name=service.name)

    async def shut_down() -> None:
        await service.stop()
        await asyncio.wait_for(task, timeout=60)

    stack.push_async_callback(shut_down)


def replica(name: str, lending: LendingConfig) -> RolloutWorkerService:
    return RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id=name,
            policy=PolicyConfig(device="cpu", seed=7),  # not the trainer's: it must take v0
            consume_tasks=False,
            serve=ServeConfig(port=free_port(), max_queued_requests=256, max_requests_per_key=256),
            weights=trusting(promoted_only=True, decode_process=False),
            same_host=SameHostTakeConfig(enabled=False),
            lending=lending,
            max_batch_tasks=2,
            fetch_timeout_s=0.2,
            drain_timeout_s=10.0,
        )
    )


def rollout_worker(name: str) -> RolloutWorkerService:
    """A rollout-worker of the RL cluster's own (it serves no one)."""
    return RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id=name,
            policy=PolicyConfig(device="cpu", seed=7),
            weights=trusting(decode_process=False),
            same_host=SameHostTakeConfig(enabled=False),
            max_batch_tasks=2,
            fetch_timeout_s=0.2,
            drain_timeout_s=10.0,
        )
    )


def trainer(run_dir: Path, batch_groups: int) -> TrainerService:
    return TrainerService(
        TrainerSettings(
            run_dir=run_dir,
            policy=PolicyConfig(device="cpu"),
            batch_groups=batch_groups,
            eval=EvalGateConfig(every_versions=100_000, num_tasks=2),  # promotes v0 only
            checkpoint_every_steps=100_000,
            same_host=SameHostShareConfig(enabled=False),
        )
    )


@contextlib.asynccontextmanager
async def serving_fleet(
    bus: Bus,
    run_dir: Path,
    lendings: list[LendingConfig],
    controller: ControllerConfig,
    rollout_workers: int = 0,
    batch_groups: int = 1,
    feeder_ahead: int = 1,
) -> AsyncIterator[Fleet]:
    """The fleet; `rollout_workers` of the RL cluster's own beside the replicas, the trainer's
    `batch_groups` a step, the feeder `feeder_ahead` batches ahead of it."""
    await provision(bus.js)
    replicas = [replica(f"replica-{i + 1}", c) for i, c in enumerate(lendings)]
    workers = [rollout_worker(f"worker-{i + 1}") for i in range(rollout_workers)]
    backends = []
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=120))
        services: list[Service] = [
            EnvGatewayService(
                EnvGatewaySettings(
                    feeder=FeederConfig(mode="async", max_ahead_versions=feeder_ahead)
                )
            ),
            RewardService(RewardSettings(fetch_timeout_s=0.2)),
            WeightBroadcasterService(
                WeightBroadcasterSettings(run_dir=run_dir, encode=EncodeOptions(threads=1))
            ),
            *replicas,
            *workers,
        ]
        for service in services:
            await start(stack, service, bus)
        for r in replicas:
            health = HealthServer(r.health, "127.0.0.1", 0, ready=r.ready)
            await health.start()
            stack.push_async_callback(health.stop)
            url = f"http://127.0.0.1:{r.settings.serve.port}"
            backends.append(Backend(url, f"http://127.0.0.1:{health.port}/readyz"))
        the_trainer = trainer(run_dir, batch_groups)
        await start(stack, the_trainer, bus)  # announces v0; its gate promotes it
        settings = CapacityControllerSettings(fleet=controller, tick_s=0.5, stale_s=5.0,
                                              settle_s=3.0)  # fmt: skip
        the_controller = CapacityControllerService(settings)
        await start(stack, the_controller, bus)
        balancer = ReadyBalancer(backends, http)
        probing = asyncio.create_task(balancer.probe_forever(0.1))
        stack.callback(probing.cancel)
        yield Fleet(bus, run_dir, the_trainer, replicas, the_controller, balancer)


async def scored_workers(bus: Bus) -> dict[str, str]:
    """Rollout id -> the worker that rolled it out, for every scored rollout."""
    name = streams.ROLLOUTS_SCORED.name
    info = await bus.js.stream_info(name)
    found: dict[str, str] = {}
    if not info.state.messages:
        return found
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(name, seq)
        scored = wire.decode(ScoredRollout, raw.data or b"", dict(raw.headers or {}))
        found[scored.rollout.rollout_id] = scored.rollout.worker_id
    return found


async def queued_task_ids(bus: Bus) -> set[str]:
    """The ids of the tasks on the work queue now."""
    info = await bus.js.stream_info(streams.TASKS.name)
    found: set[str] = set()
    if not info.state.messages:
        return found
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(streams.TASKS.name, seq)
        except NotFoundError:  # taken and acked
            continue
        found.add(wire.decode(Task, raw.data or b"", dict(raw.headers or {})).task_id)
    return found


async def announced_hash(bus: Bus, version: int) -> str:
    """The signed hash of `version` as the weight-broadcaster announced it."""
    name = streams.WEIGHTS_ANNOUNCE.name
    info = await bus.js.stream_info(name)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(name, seq)
        announcement = wire.decode(WeightAnnouncement, raw.data or b"", dict(raw.headers or {}))
        if announcement.version == version:
            return announcement.version_hash
    raise AssertionError(f"version {version} is not announced")
