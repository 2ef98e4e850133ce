"""Issue #32's serving fleet end to end: three serve replicas under a product load that falls
and rises, real HTTP through a load balancer that honours readiness, the capacity controller
lending and recalling, the trainer training on what the lent replicas roll out
(tests/fleet_support.py has the fleet).

At low load the controller lends two replicas; they roll out tasks the trainer trains on.
When the load rises it recalls them. No product request fails, no episode is lost or
trained twice (by rollout ids), the restored weights hash to the promoted version's signed
hash, and `rlpipe fleet` prints the ledger and the decisions.

Run: .venv/bin/python -m pytest tests/test_fleet_e2e.py -q
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from apps.cli import main as rlpipe
from libs.bus.connection import Bus
from libs.fleet.config import ControllerConfig, LendingConfig
from libs.fleet.ledger import read_decisions
from libs.trainer.metrics import read_step_samples
from libs.weights.gpu import device_state_hash
from proto import streams
from tests.conftest import wait_for
from tests.fleet_support import (
    Fleet,
    ProductLoad,
    announced_hash,
    queued_task_ids,
    scored_workers,
    serving_fleet,
)
from tests.marks import E2E

pytestmark = E2E

# One replica serves 2 requests/s with 50% headroom: 0.4 req/s needs one, 3.5 all three.
CONTROLLER = ControllerConfig(
    replica_capacity_rps=2.0,
    headroom=0.5,
    min_serving=1,
    lend_after_s=2.0,
    cooldown_s=2.0,
    recall_lead_s=2.0,
    trend_window_s=4.0,
)
LOW_RPS, HIGH_RPS = 0.4, 3.5
# Requests are answered for a second after readiness turns off (the balancer probes every
# 0.1 s); replica-1 hands its episodes back at a recall, the others let theirs finish.
LENDING = [
    LendingConfig(enabled=True, heartbeat_s=0.5, load_window_s=4.0, unready_grace_s=1.0,
                  recall_grace_s=0.0 if i == 0 else 30.0)
    for i in range(3)
]  # fmt: skip


def restored_hash(fleet: Fleet, name: str) -> str:
    replica = next(r for r in fleet.replicas if r.settings.worker_id == name)
    assert replica.engine is not None and replica.follower is not None
    live = replica.engine.live_tensors()
    assert live is not None and replica.lending is not None
    names = list(replica.lending.parts.follower.promoted_copy()[1])  # type: ignore[index]
    return device_state_hash({n: live[n] for n in names})


async def trained_from(fleet: Fleet, workers: set[str]) -> bool:
    """Whether a trainer step trained on a rollout of one of `workers`."""
    trained = {i for s in read_step_samples(fleet.run_dir) for i in s.sample_ids}
    by_worker = await scored_workers(fleet.bus)
    return any(by_worker.get(i) in workers for i in trained)


async def test_the_controller_lends_at_low_load_and_recalls_as_it_rises(
    bus: Bus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with serving_fleet(bus, tmp_path, LENDING, CONTROLLER) as fleet:
        await wait_for(lambda: len(fleet.serving()) + len(fleet.lent()) == 3, 180, "v0 served")
        promoted_hash = await announced_hash(bus, 0)  # before the chain is pruned past it
        load = ProductLoad(fleet.balancer, LOW_RPS)
        sending = asyncio.create_task(load.run())
        await wait_for(lambda: len(fleet.lent()) == 2, 180, "two replicas lent at low load")
        lent = fleet.lent()
        await wait_for(lambda: trained_from(fleet, lent), 300, "a step on lent replicas' rollouts")

        load.rate_rps = HIGH_RPS
        await wait_for(lambda: len(fleet.serving()) == 3, 180, "both recalled as load rises")
        await asyncio.sleep(3.0)  # the whole fleet serves the high load for a while
        sending.cancel()
        await load.drain()

        failed = Counter(a.status for a in load.failed())
        assert len(load.answers) > 10 and not failed, failed
        decisions = await read_decisions(bus.js, last=100)
        actions = [(d.action, d.replica_id) for d in decisions if d.accepted]
        assert sorted(actions) == sorted([(a, r) for r in lent for a in ("lend", "recall")])
        assert all(d.reason and d.decided_by == "capacity-controller" for d in decisions)
        for r in fleet.replicas:
            assert r.lending is not None and r.engine_version == 0
            if r.settings.worker_id in lent:
                record = r.lending.last_recall
                assert record is not None and record.hash_matches
                assert record.restored_hash == promoted_hash
            assert restored_hash(fleet, r.settings.worker_id) == promoted_hash

        steps = read_step_samples(fleet.run_dir)
        trained = [i for s in steps for i in s.sample_ids]
        assert len(trained) == len(set(trained)), "a rollout trained twice"
        requeued = {t for r in fleet.replicas if r.lending and r.lending.last_recall
                    for t in r.lending.last_recall.requeued_task_ids}  # fmt: skip
        await _assert_requeued_tasks_kept(bus, requeued)

        url = fleet_url(bus)  # the commands a user runs (in a thread: they run their own loop)
        assert await asyncio.to_thread(rlpipe, ["fleet", "--nats-url", url, "status"]) == 0
        ledger = capsys.readouterr().out
        assert all(f"replica-{i} " in ledger for i in (1, 2, 3)) and "serving" in ledger
        assert await asyncio.to_thread(rlpipe, ["fleet", "--nats-url", url, "decisions"]) == 0
        assert "recall" in capsys.readouterr().out


async def _assert_requeued_tasks_kept(bus: Bus, requeued: set[str]) -> None:
    """A task a recall handed back is rolled out elsewhere (its rollouts stored) or still on
    the work queue; none is dead-lettered."""
    dead = await bus.js.stream_info(streams.DEAD_LETTERS.name)
    assert dead.state.messages == 0
    if not requeued:
        return
    rolled_out = {i.rsplit(".", 1)[0] for i in await scored_workers(bus)}
    assert requeued - rolled_out <= await queued_task_ids(bus), "a requeued task was lost"


def fleet_url(bus: Bus) -> str:
    url = bus.nc.connected_url
    assert url is not None
    return f"nats://{url.hostname}:{url.port}"
