"""A region trains the hub's policy over the shipped configs: the hub and one region on
loopback (tests/region_support.py: deploy/nats/hub.conf and region-leaf.conf, each service
its own user), the trainer, weight-broadcaster, env-gateway and reward on the hub as
themselves, the region's relay mirroring the hub's weight streams, and a rollout-worker that
pulls tasks and publishes rollouts on the hub as `rollout-worker` while its weights come
over the leaf link from the region's mirrors (as the region's `rollout-worker`).

Same-host sharing is off: the worker runs on the trainer's machine here, and would otherwise
take each version from the trainer's memory instead of through the region.

Run: .venv/bin/python -m pytest tests/test_region_training.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus import wire
from libs.bus.connection import Bus, connect_bus
from libs.envs.feeder import FeederConfig
from libs.nats_server import NatsServer
from libs.policy import PolicyConfig
from libs.service import Service
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.metrics import read_steps
from libs.weights.encoder import EncodeOptions
from libs.weights.relay import setup_relay
from libs.weights.same_host import SameHostShareConfig, SameHostTakeConfig
from proto import permissions, streams
from proto.messages import ScoredRollout
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
from tests.region_support import REGION_PASSWORDS, hub_user, linked_servers, region_user
from tests.signing_support import trusting

pytestmark = E2E

STEPS = 4


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[NatsServer, NatsServer]]:
    with linked_servers(tmp_path / "hub", tmp_path / "region") as pair:
        yield pair


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as services:
        yield services


async def run_as(stack: AsyncExitStack, service: Service, url: str, role: str) -> None:
    """Start `service` on its own connection as `role` (a hub user); stopped with the stack."""
    bus = await connect_bus(url, name=role, options=hub_user(role))
    stack.push_async_callback(bus.close)
    await service.start(bus)
    task = asyncio.create_task(service.run(), name=service.name)

    async def shut_down() -> None:
        await service.stop()
        await asyncio.wait_for(task, timeout=30)

    stack.push_async_callback(shut_down)


async def scored_versions(bus: Bus) -> list[int]:
    """The policy versions of the assistant turns of every scored rollout on the hub."""
    name = streams.ROLLOUTS_SCORED.name
    info = await bus.js.stream_info(name)
    versions = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(name, seq)
        scored = wire.decode(ScoredRollout, raw.data or b"", dict(raw.headers or {}))
        assert scored.rollout.worker_id == "region-worker"
        versions += [t.policy_version or 0 for t in scored.rollout.turns if t.role == "assistant"]
    return versions


async def test_a_regional_worker_takes_weights_through_the_leaf_link_and_the_trainer_learns(
    servers: tuple[NatsServer, NatsServer], stack: AsyncExitStack, tmp_path: Path
) -> None:
    hub, region = servers
    relay = await connect_bus(region.url, "relay", options=region_user("relay"))
    stack.push_async_callback(relay.close)
    await setup_relay(relay.js, hub_domain=permissions.HUB_DOMAIN)
    run_dir = tmp_path / "run"
    # The region's rollout-worker user comes with the regional server's URL.
    region_url = region.url.replace(
        "nats://", f"nats://rollout-worker:{REGION_PASSWORDS['rollout-worker']}@"
    )
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="region-worker",
            policy=PolicyConfig(device="cpu", seed=9),  # not the trainer's: it must take its
            weights=trusting(nats_url=region_url),
            same_host=SameHostTakeConfig(enabled=False),
            max_batch_tasks=2,
            fetch_timeout_s=0.2,
            drain_timeout_s=5.0,
        )
    )
    trainer = TrainerService(
        TrainerSettings(
            run_dir=run_dir,
            policy=PolicyConfig(device="cpu"),
            batch_groups=1,
            eval=EvalGateConfig(every_versions=0),
            checkpoint_every_steps=1000,
            same_host=SameHostShareConfig(enabled=False),
        )
    )
    started = [
        (EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="async"))), "env-gateway"),
        (RewardService(RewardSettings(fetch_timeout_s=0.2)), "reward"),
        (
            WeightBroadcasterService(
                WeightBroadcasterSettings(run_dir=run_dir, encode=EncodeOptions(threads=1))
            ),
            "weight-broadcaster",
        ),
        (worker, "rollout-worker"),
        (trainer, "trainer"),
    ]
    for service, role in started:
        await run_as(stack, service, hub.url, role)

    def trained_steps() -> bool:
        return len(read_steps(run_dir)) >= STEPS

    await wait_for(trained_steps, 180, f"{STEPS} trainer steps on the region's rollouts")
    # The worker's weights came from the region's server, and it rolled out with versions
    # the trainer published after it started (each through the hub's streams, the leaf link
    # and the region's mirrors).
    assert worker.regional_bus is not None
    assert worker.engine_version is not None and worker.engine_version >= 1
    admin = await connect_bus(hub.url, name="admin", options=hub_user("admin"))
    stack.push_async_callback(admin.close)
    assert max(await scored_versions(admin)) >= 1
    steps = read_steps(run_dir)
    assert sum(step.num_samples for step in steps) > 0
    # Every service did its job within its own permissions.
    for server in (hub, region):
        log = (server.store_dir / "nats-server.log").read_text()
        assert "Violation" not in log, server.store_dir  # Publish or Subscription Violation
