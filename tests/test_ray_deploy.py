"""The Ray deployment (`rlpipe ray ...`, apps/ray_deploy): the scaling rule, the core's
independence from Ray, and the demo's services run as Ray actors on a local multi-node Ray
cluster (ray.cluster_utils.Cluster, CPU only).

Ray is the optional extra `.[ray]`, included in `.[dev]`, so CI runs every test here; the
tests that need Ray skip, saying so, only where it is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.ray_deploy.plan import ScalePolicy, build_plan, desired_workers, parse_assignments

REPO_ROOT = Path(__file__).resolve().parent.parent

# --- the scaling rule --------------------------------------------------------------------

POLICY = ScalePolicy(min_workers=1, max_workers=4, tasks_per_worker=50, shrink_after_polls=3)


def test_a_growing_backlog_adds_workers_at_once_up_to_the_maximum() -> None:
    assert desired_workers(POLICY, current=1, pending=120, drained_polls=0) == 3
    assert desired_workers(POLICY, current=1, pending=10_000, drained_polls=0) == 4


def test_a_drained_backlog_removes_one_worker_only_after_enough_quiet_polls() -> None:
    assert desired_workers(POLICY, current=3, pending=0, drained_polls=2) == 3
    assert desired_workers(POLICY, current=3, pending=0, drained_polls=3) == 2
    assert desired_workers(POLICY, current=1, pending=0, drained_polls=99) == 1  # the minimum


def test_new_bounds_move_the_tier_inside_them() -> None:
    assert desired_workers(ScalePolicy(min_workers=2, max_workers=3), 1, 0, 0) == 2
    assert desired_workers(ScalePolicy(min_workers=0, max_workers=2), 4, 0, 0) == 2


def test_bad_bounds_and_unknown_services_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"min \(3\) <= max \(2\)"):
        ScalePolicy(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="trainr"):
        build_plan("nats://x:4222", "/tmp/run", gpus={"trainr": 1})
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_assignments(["trainer"], "--gpus")


def test_the_plan_asks_gpus_where_given_and_carries_the_bus_to_every_service() -> None:
    plan = build_plan(
        "nats://a:4222,nats://b:4222", "/runs/x", gpus={"trainer": 1}, nats_replicas=3
    )
    assert plan.service("trainer").num_gpus == 1 and plan.service("reward").num_gpus == 0
    for service in plan.services:
        assert service.env["RLPIPE_NATS_URL"] == "nats://a:4222,nats://b:4222"
        assert service.env["RLPIPE_NATS_REPLICAS"] == "3"


def test_the_core_never_imports_ray() -> None:
    """Every service, the CLI (with its `ray` verb registered) and the demo load without it."""
    code = (
        "import sys, importlib\n"
        "import apps.cli, apps.launcher.run, apps.ray_deploy.plan, apps.ray_deploy.cli\n"
        "apps.cli.build_parser()\n"
        "for name in apps.cli.SERVICES:\n"
        "    importlib.import_module('services.' + name.replace('-', '_') + '.service')\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --- on a local multi-node Ray cluster ------------------------------------------------------

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed: pip install -e '.[ray]' (the dev extra includes it)",
)

BURST_TASKS = 480
GROUP_SIZE = 16


@pytest.fixture
def ray_cluster() -> Iterator[Any]:
    """Three Ray nodes of 2 logical CPUs each on this machine, this process connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def rlpipe_ray(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apps.cli", "ray", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_demo_on_ray_learns_restarts_a_killed_actor_and_scales_with_the_backlog(
    tmp_path: Path, ray_cluster: Any
) -> None:
    import ray

    from libs.nats_server import NatsServer

    nats = NatsServer(store_dir=tmp_path / "nats")
    nats.start()
    run_dir = tmp_path / "run"
    address = ray_cluster.address
    try:
        up = rlpipe_ray(
            "up", "--address", address, "--nats-url", nats.url, "--run-dir", str(run_dir),
            "--min-workers", "1", "--max-workers", "2", "--tasks-per-worker", "100",
            "--poll-s", "1", "--cpus", "trainer=0.5", "--cpus", "rollout-worker=0.5",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:]
        status = wait_status(address, lambda s: reward_curve(run_dir)[5:], 300, "5 steps")

        # A killed service actor comes back: a new process, healthy again.
        reward_actor = ray.get_actor("rlpipe-reward", namespace="rlpipe")
        old_pid = actor_entry(status, "rlpipe-reward")["pid"]
        ray.kill(reward_actor, no_restart=False)
        status = wait_status(
            address, lambda s: restarted(s, "rlpipe-reward", old_pid), 180, "reward restarted"
        )
        assert actor_entry(status, "rlpipe-reward")["restarts"] >= 1

        # A burst of tasks grows the rollout tier; once drained it shrinks back.
        burst = asyncio.run(publish_burst(nats.url))
        grown = wait_status(address, lambda s: s["workers"] == 2, 120, "a second worker")
        assert any(e["event"] == "growing" for e in grown["events"]), grown["events"]
        shrunk = wait_status(
            address,
            lambda s: any(e["event"] == "removed" for e in s["events"]) and s["workers"] == 1,
            300,
            "the second worker removed",
        )
        assert len([a for a in shrunk["actors"] if "rollout-worker" in a["actor"]]) == 1
        removed = next(e for e in shrunk["events"] if e["event"] == "removed")
        drained = (run_dir / "logs" / f"{removed['actor']}.log").read_text()
        assert '"consumer stopped"' in drained, f"{removed['actor']} did not stop pulling"

        # Learned: the mean reward of 10 steps above 0.8.
        wait_status(address, lambda s: best_mean(reward_curve(run_dir)) > 0.8, 420, "reward > 0.8")
        status_cli = rlpipe_ray("status", "--address", address, "--json")
        assert status_cli.returncode == 0, status_cli.stderr[-2000:]
        shown = json.loads(status_cli.stdout.strip().splitlines()[-1])
        assert shown["cluster"]["nodes"] == 3
        pids = [a["pid"] for a in shown["actors"]]
        assert {a["actor"] for a in shown["actors"]} >= {"rlpipe-trainer", "rlpipe-reward"}

        down = rlpipe_ray("down", "--address", address, timeout_s=240)
        assert down.returncode == 0, down.stderr[-2000:]
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 60), "a service survived"
        lost = asyncio.run(burst_tasks_not_scored(nats.url, burst))
        assert lost == [], f"{len(lost)} burst tasks never scored: {lost[:5]}"
        assert no_sample_trained_twice(run_dir)
    finally:
        nats.stop()


def wait_status(
    address: str, condition: Callable[[dict[str, Any]], Any], timeout_s: float, what: str
) -> dict[str, Any]:
    """Poll the controller's status until `condition(status)`; fail naming `what`."""
    import ray

    from apps.ray_deploy.controller import find_controller

    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = ray.get(find_controller().status.remote())
        if condition(status):
            return status
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {status}")


def actor_entry(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in status["actors"] if a["actor"] == name)


def restarted(status: dict[str, Any], name: str, old_pid: int) -> bool:
    entry = actor_entry(status, name)
    health = entry.get("health") or {}
    return entry.get("pid") not in (None, old_pid) and health.get("status") == "ok"


def reward_curve(run_dir: Path) -> list[float]:
    path = run_dir / "trainer" / "steps.jsonl"
    if not path.exists():
        return []
    curve = []
    for line in path.read_text().splitlines():
        try:
            curve.append(json.loads(line)["mean_reward"])
        except (json.JSONDecodeError, KeyError):
            break
    return curve


def best_mean(curve: list[float], window: int = 10) -> float:
    means = [sum(curve[i - window : i]) / window for i in range(window, len(curve) + 1)]
    return max(means, default=0.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    return False


async def publish_burst(url: str) -> list[str]:
    """BURST_TASKS arith tasks of their own seed, straight onto the task stream."""
    from libs.bus.connection import connect_bus
    from libs.bus.publisher import Outgoing, Publisher
    from libs.domains.arith.env import ArithmeticTasks
    from proto.subjects import task_subject

    source = ArithmeticTasks(difficulty=0, group_size=GROUP_SIZE, seed=4242)
    tasks = [source.task(i) for i in range(BURST_TASKS)]
    bus = await connect_bus(url, name="pytest-burst")
    try:
        items = (Outgoing(task_subject("arith"), t, msg_id=t.task_id) for t in tasks)
        await Publisher(bus.js).publish_many(items)
    finally:
        await bus.close()
    return [t.task_id for t in tasks]


async def burst_tasks_not_scored(url: str, task_ids: list[str]) -> list[str]:
    """Burst tasks whose whole group is not in the scored stream."""
    from libs.bus import wire
    from libs.bus.connection import connect_bus
    from proto import streams
    from proto.messages import ScoredRollout

    bus = await connect_bus(url, name="pytest-audit")
    counts: dict[str, int] = {}
    try:
        info = await bus.js.stream_info(streams.ROLLOUTS_SCORED.name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await bus.js.get_msg(streams.ROLLOUTS_SCORED.name, seq=seq)
            scored = wire.decode(ScoredRollout, raw.data or b"", raw.headers)
            task_id = scored.rollout.task_id
            counts[task_id] = counts.get(task_id, 0) + 1
    finally:
        await bus.close()
    return [t for t in task_ids if counts.get(t, 0) != GROUP_SIZE]


def no_sample_trained_twice(run_dir: Path) -> bool:
    from tests.chaos_support import effective_steps, read_steps

    samples = effective_steps(read_steps(run_dir, "step_samples.jsonl"))
    trained = [sid for record in samples for sid in record["sample_ids"]]
    assert trained, "no trained sample ids recorded"
    return len(trained) == len(set(trained))
