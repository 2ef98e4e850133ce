"""The bus on a 3-node JetStream cluster: replication by provisioning, clients that ride
through a node's death, and `rlpipe demo --nats-cluster 3` training on through the loss of
the node that leads the scored stream.

The cluster is real: three nats-server processes routed together (libs.nats_server.NatsCluster),
each with its own JetStream folder. A node is killed with SIGKILL by its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog.testing
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.connection import Bus, connect_bus, ride_through, server_urls
from libs.bus.provision import ProvisionError, ensure_stream, provision
from libs.bus.publisher import Publisher
from libs.nats_server import NatsCluster, find_nats_server, free_port
from proto import streams
from proto.messages import DeadLetter, Rollout, ScoredRollout, Task
from proto.permissions import ROLES
from proto.streams import StreamSpec
from tests.chaos_support import (
    _cursor,
    _read_scored_and_dead,
    audit,
    effective_steps,
    read_pids,
    read_steps,
    stop_demo,
)
from tests.conftest import wait_for

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    nodes = NatsCluster(root=tmp_path_factory.mktemp("cluster"), size=3)
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture
async def cluster_bus(cluster: NatsCluster) -> AsyncIterator[Bus]:
    for node in cluster.nodes:  # a test that killed a node and failed before restarting it
        if not node.running:
            node.start()
    cluster.wait_jetstream()
    bus = await connect_bus(cluster.url, name="pytest-cluster")
    for info in await bus.js.streams_info():
        assert info.config.name is not None
        await bus.js.delete_stream(info.config.name)
    yield bus
    await bus.close()


def test_a_cluster_url_lists_every_node(cluster: NatsCluster) -> None:
    assert server_urls(cluster.url) == [node.url for node in cluster.nodes]
    assert server_urls(" nats://a:1, nats://b:2 ,") == ["nats://a:1", "nats://b:2"]


async def test_provisioning_keeps_every_stream_and_bucket_on_three_nodes(
    cluster_bus: Bus,
) -> None:
    report = await provision(cluster_bus.js, replicas=3)
    assert set(report.outcomes.values()) == {"created"}
    for spec in streams.ALL_STREAMS:
        info = await cluster_bus.js.stream_info(spec.name)
        assert info.config.num_replicas == 3, spec.name
        assert info.cluster is not None and info.cluster.leader
        assert len(info.cluster.replicas or []) == 2, spec.name  # the two followers
    for bucket in streams.ALL_KV:
        info = await cluster_bus.js.stream_info(f"KV_{bucket.bucket}")
        assert info.config.num_replicas == 3, bucket.bucket
    again = await provision(cluster_bus.js, replicas=3)
    assert not again.changed, again.outcomes


async def test_a_running_stream_and_bucket_scale_from_one_to_three_replicas(
    cluster_bus: Bus,
) -> None:
    await provision(cluster_bus.js, replicas=1)
    await cluster_bus.js.publish(f"{streams.TASKS.subjects[0][:-1]}arith", b"kept")
    report = await provision(cluster_bus.js, replicas=3)
    assert report.outcomes[f"stream {streams.TASKS.name}"] == "updated"
    assert report.outcomes[f"kv {streams.STATE.bucket}"] == "updated"
    info = await cluster_bus.js.stream_info(streams.TASKS.name)
    assert info.config.num_replicas == 3 and info.state.messages == 1


async def test_replicas_on_a_single_server_are_refused_with_the_fix(bus: Bus) -> None:
    with pytest.raises(ProvisionError, match="RLPIPE_NATS_REPLICAS=1"):
        await provision(bus.js, (streams.TASKS,), (), (), replicas=3)
    with pytest.raises(ProvisionError, match="replicas must be 1 to 5"):
        await provision(bus.js, (streams.TASKS,), (), (), replicas=7)


async def test_provisioning_waits_for_a_node_that_joins_the_cluster_late(tmp_path: Path) -> None:
    """Two of three nodes up: R3 cannot be placed ("no suitable peers"), so provisioning
    waits; the third node starts once it has said so and every stream lands on all three (a
    compose cluster whose services provision while a node is still starting)."""
    late = NatsCluster(root=tmp_path, size=3)
    try:
        for node in late.nodes[:2]:
            node.start()
        late.wait_jetstream()
        bus = await connect_bus(late.nodes[0].url, name="pytest-late")
        try:
            with structlog.testing.capture_logs() as logs:
                provisioning = asyncio.create_task(
                    ride_through(lambda: provision(bus.js, replicas=3), "provision")
                )

                def waiting_for_peers() -> bool:  # a fixed sleep missed it on a busy machine
                    return provisioning.done() or any(
                        "no peers for placement" in entry["event"] for entry in logs
                    )

                await wait_for(waiting_for_peers, 120, "provisioning waiting for peers")
                assert not provisioning.done(), f"ended on two nodes: {provisioning.exception()!r}"
                late.nodes[2].start()
                report = await asyncio.wait_for(provisioning, timeout=60)
            assert set(report.outcomes.values()) == {"created"}
            info = await bus.js.stream_info(streams.ROLLOUTS_SCORED.name)
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            await bus.close()
    finally:
        late.stop()


async def test_no_acknowledged_message_is_lost_when_the_stream_leader_dies(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    spec = StreamSpec(name="CLUSTER_PROBE", subjects=("probe.>",), description="probe")
    await ensure_stream(cluster_bus.js, spec, replicas=3)
    publisher = Publisher(cluster_bus.js, ack_timeout_s=2.0, max_attempts=20)
    acked: list[int] = []

    async def publish(first: int, count: int) -> None:
        for index in range(first, first + count):
            await publisher.publish_raw("probe.x", b"%d" % index, {"Nats-Msg-Id": str(index)})
            acked.append(index)

    await publish(0, 200)
    leader = cluster.stream_leader(spec.name)
    assert leader is not None
    victim = cluster.node(leader)
    assert victim.process is not None
    writing = asyncio.create_task(publish(200, 800))
    await asyncio.sleep(0.05)
    victim.process.send_signal(signal.SIGKILL)  # mid-stream: publishes in flight
    await asyncio.wait_for(writing, timeout=120)
    new_leader = cluster.stream_leader(spec.name)
    assert new_leader not in (None, leader), "no other node took over the stream"

    stored = await read_all(cluster_bus, spec.name)
    assert acked == list(range(1000))
    assert sorted(stored) == acked, "an acknowledged message is missing or stored twice"
    victim.start()  # the node rejoins on its folder and catches up
    cluster.wait_jetstream()


async def read_all(bus: Bus, stream: str) -> list[int]:
    """Every value stored in `stream`, read through the moments after a leader change (the
    new leader answered 503 "JetStream system temporarily unavailable" to a read right after
    the failover, once in make test), as the services ride through them."""
    info = await ride_through(partial(bus.js.stream_info, stream), stream)
    values = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        message = await ride_through(partial(bus.js.get_msg, stream, seq=seq), stream)
        values.append(int(message.data or b"-1"))
    return values


# --- the demo on a cluster ---------------------------------------------------------------

MAX_STEPS = 24
KILL_AT_STEP = 8
DEMO = [sys.executable, "-m", "apps.cli", "demo", "--max-trainer-steps", str(MAX_STEPS)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_trains_on_through_the_death_of_the_scored_stream_leader(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    demo = subprocess.Popen(
        [*DEMO, "--nats-cluster", "3", "--run-dir", str(run_dir), "--duration-s", "300"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        killed = kill_scored_leader(run_dir, demo)
        stdout, _ = demo.communicate(timeout=330)
    finally:
        stop_demo(demo, run_dir)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert demo.returncode == 0, summary
    assert summary["stop_reason"] == "max_trainer_steps", summary
    steps = effective_steps(read_steps(run_dir))
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    after = [s for s in steps if s["time"] > killed["time"]]
    assert len(after) >= MAX_STEPS - KILL_AT_STEP - 2, "training did not go on after the kill"

    accounting, tasks = audit_cluster(run_dir)
    assert accounting["trained_twice"] == 0, accounting
    assert accounting["stored_twice"] == 0, accounting
    assert accounting["unaccounted"] == 0, accounting
    assert tasks["num_lost"] == 0, tasks
    assert tasks["published"] > 0


def kill_scored_leader(run_dir: Path, demo: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGKILL the node that leads RL_ROLLOUTS_SCORED once the trainer reaches KILL_AT_STEP."""
    assert wait_until(
        lambda: len(read_steps(run_dir)) >= KILL_AT_STEP or demo.poll() is not None, 240
    )
    if demo.poll() is not None:
        assert demo.stdout is not None
        ending = demo.stdout.read().strip().splitlines()[-1:]
        logs = {p.name: p.read_text()[-600:] for p in (run_dir / "logs").glob("nats*.log")}
        pytest.fail(f"the demo ended ({demo.returncode}) before the kill: {ending} {logs}")
    leader = scored_leader(run_dir)
    assert leader is not None, "nobody leads the scored stream"
    pid = json.loads((run_dir / "pids.json").read_text())["nats_nodes"][leader]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    def moved() -> bool:
        """A live process leads the stream: another node, or the killed node restarted by the
        launcher (on its folder, under its name), which can win the election it caused."""
        now = scored_leader(run_dir, but=leader)
        if now is not None and now != leader:
            return True
        restarted = read_pids(run_dir).get("nats_nodes", {}).get(leader) != pid
        return restarted and scored_leader(run_dir, only=leader) == leader

    # Asked of the nodes' monitoring ports: a client connect could wait on the node being
    # restarted by the launcher, long enough for the demo to finish its steps meanwhile.
    assert wait_until(moved, 30, demo), "no live node took over the scored stream"
    return {"node": leader, "pid": pid, "time": killed_at}


def scored_leader(run_dir: Path, but: str | None = None, only: str | None = None) -> str | None:
    """The node leading the scored stream as the demo's nodes (all, all but `but`, or `only`
    that one) report it on their monitoring ports; None while none can say (an election)."""
    for config in sorted((run_dir / "nats").glob("n*/nats.conf")):
        if config.parent.name == but or only not in (None, config.parent.name):
            continue
        line = next(x for x in config.read_text().splitlines() if x.startswith("http_port:"))
        url = f"http://127.0.0.1:{int(line.split(':')[1])}/jsz?streams=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                document = json.loads(reply.read())
        except (OSError, ValueError):
            continue
        for account in document.get("account_details", []):
            for detail in account.get("stream_detail", []):
                leader = detail.get("cluster", {}).get("leader")
                if detail.get("name") == streams.ROLLOUTS_SCORED.name and leader:
                    return str(leader)
    return None


def wait_until(
    condition: Callable[[], bool], timeout_s: float, demo: subprocess.Popen[str] | None = None
) -> bool:
    """True once `condition` holds; False after `timeout_s` or once `demo` has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (demo is None or demo.poll() is None):
        if condition():
            return True
        time.sleep(0.25)
    return False


def audit_cluster(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restart the stopped demo's cluster on its folders and account for every sample and
    every task the feeder had acknowledged."""
    cluster = NatsCluster(root=run_dir / "nats", size=3, log_dir=run_dir / "logs")
    cluster.start()
    try:
        asyncio.run(wait_for_stream_leaders(cluster.url))
        stored, dead = asyncio.run(_read_scored_and_dead(cluster.url))
        tasks = asyncio.run(account_tasks(cluster.url))
    finally:
        cluster.stop()
    samples = effective_steps(read_steps(run_dir, "step_samples.jsonl"))
    return audit(stored, dead, samples, _cursor(run_dir)), tasks


async def wait_for_stream_leaders(url: str) -> None:
    """After a whole-cluster restart each stream's Raft group elects its leader again (a few
    seconds); its API answers only then."""
    bus = await connect_bus(url, name="cluster-audit")
    try:
        for spec in streams.ALL_STREAMS:
            await ride_through(partial(bus.js.stream_info, spec.name), spec.name)
    finally:
        await bus.close()


async def account_tasks(url: str) -> dict[str, Any]:
    """Every task the feeder had acknowledged (indexes below its stored next_index) must be
    somewhere: still queued, rolled out (its rollouts raw or scored), or dead-lettered."""
    from libs.envs.feeder import FeederState, feeder_state_key

    bus = await connect_bus(url, name="cluster-audit")
    try:
        kv = await bus.js.key_value(streams.STATE.bucket)
        entry = await kv.get(feeder_state_key("arith"))
        state = msgspec.json.decode(entry.value or b"{}", type=FeederState)
        seen: set[int] = set()
        for stream in (TASKS, RAW, SCORED, DEAD):
            for message in await typed_messages(bus, stream):
                seen.add(int(task_id_of(message).rsplit("-", 1)[1]))
    finally:
        await bus.close()
    lost = [index for index in range(state.next_index) if index not in seen]
    return {"published": state.next_index, "lost": lost[:10], "num_lost": len(lost)}


TASKS, RAW, SCORED, DEAD = (
    streams.TASKS.name,
    streams.ROLLOUTS_RAW.name,
    streams.ROLLOUTS_SCORED.name,
    streams.DEAD_LETTERS.name,
)
KIND_OF_STREAM: dict[str, type[Task] | type[Rollout] | type[ScoredRollout]] = {
    TASKS: Task,
    RAW: Rollout,
    SCORED: ScoredRollout,
}


async def typed_messages(bus: Bus, stream: str) -> list[Task | Rollout | ScoredRollout]:
    """Every message of `stream`, decoded; a dead letter as the message it holds."""
    info = await bus.js.stream_info(stream)
    found: list[Task | Rollout | ScoredRollout] = []
    if info.state.messages == 0:
        return found
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(stream, seq=seq)
        except NotFoundError:  # a work queue's acked message
            continue
        if stream != DEAD:
            found.append(wire.decode(KIND_OF_STREAM[stream], raw.data or b"", raw.headers))
            continue
        letter = wire.decode(DeadLetter, raw.data or b"", raw.headers)
        if letter.origin_stream in KIND_OF_STREAM:
            kind = KIND_OF_STREAM[letter.origin_stream]
            found.append(wire.decode(kind, letter.payload, letter.headers))
    return found


def task_id_of(message: Task | Rollout | ScoredRollout) -> str:
    if isinstance(message, ScoredRollout):
        return message.rollout.task_id
    return message.task_id


# --- the shipped cluster config (deploy/nats/cluster.conf, compose's cluster profile) -----

CLUSTER_CONF = REPO_ROOT / "deploy" / "nats" / "cluster.conf"
# Every user's password (auth.conf, included by cluster.conf through nats-secure.conf).
PASSWORDS = {
    role.password_variable: f"{role.name.replace('-', '')}0secret" for role in ROLES.values()
}


def test_the_compose_cluster_profile_adds_two_nodes_that_run_the_cluster_config(
    tmp_path: Path,
) -> None:
    from tests.compose_support import resolve_compose, started_services

    config = resolve_compose(tmp_path, "cluster")
    nodes = ["nats", "nats-2", "nats-3"]
    assert set(nodes) <= set(started_services(config, "cluster"))
    assert not {"nats-2", "nats-3"} & set(started_services(config))  # default: one server
    names = {config["services"][n]["environment"]["RLPIPE_NATS_NODE_NAME"] for n in nodes}
    assert names == set(nodes), "every node needs its own server_name"
    stores = {v for n in nodes for v in config["services"][n]["volumes"] if "/data" in str(v)}
    assert len(stores) == 3, f"the nodes share a JetStream store: {stores}"
    routes = CLUSTER_CONF.read_text()
    assert all(f"nats-route://{n}:6222" in routes for n in nodes), "a node has no route"
    for name in ("nats-2", "nats-3"):
        assert config["services"][name]["command"][-1].endswith("/cluster.conf")
        assert not config["services"][name].get("ports"), f"{name} publishes a port"


async def test_the_shipped_cluster_config_forms_a_cluster_that_outlives_a_node(
    tmp_path: Path,
) -> None:
    """Three nats-server processes on deploy/nats/cluster.conf, with users, only their
    addresses (loopback ports) and store folders replaced: the admin user provisions R3
    through the first node, which then dies; the client carries on through a node it learned
    from the cluster (with the credentials of its URL)."""
    binary = find_nats_server()
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]  # client, http, route
    routes = ",".join(f"nats-route://127.0.0.1:{route}" for _, _, route in ports)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")} | PASSWORDS
    processes = []
    try:
        for index, (client, http, route) in enumerate(ports):
            config = node_config(tmp_path / f"n{index}")
            command = [binary, "-c", str(config), "-a", "127.0.0.1", "-p", str(client)]
            command += ["-m", str(http), "--cluster", f"nats://127.0.0.1:{route}"]
            processes.append(
                subprocess.Popen(
                    [*command, "--routes", routes],
                    env=env | {"RLPIPE_NATS_NODE_NAME": f"node-{index}"},
                    stdout=(tmp_path / f"n{index}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        for (client, _, _), process, index in zip(ports, processes, range(3), strict=True):
            await accepting_clients(client, process, tmp_path / f"n{index}.log")
        password = PASSWORDS[ROLES["admin"].password_variable]
        first = f"nats://admin:{password}@127.0.0.1:{ports[0][0]}"
        bus = await connect_bus(first, name="pytest")
        try:
            await ride_through(lambda: provision(bus.js, replicas=3), "provision", limit_s=60)
            info = await bus.js.stream_info(streams.ROLLOUTS_SCORED.name)
            assert info.cluster is not None and info.config.num_replicas == 3
            assert len(info.cluster.replicas or []) == 2
            processes[0].kill()  # the only node the client was told about
            processes[0].wait()
            publisher = Publisher(bus.js, max_attempts=30)
            ack = await publisher.publish_raw(
                f"{streams.TASKS.subjects[0][:-1]}arith", b"t", {"Nats-Msg-Id": "after"}
            )
            assert ack.stream == streams.TASKS.name
            assert bus.nc.connected_url is not None
            assert bus.nc.connected_url.port in (ports[1][0], ports[2][0])
        finally:
            await bus.close()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


async def accepting_clients(
    port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 30.0
) -> None:
    """Until the node's client port answers with INFO; its log's end in the error if it died
    (a port taken between drawing it and binding it) or never answered. JetStream's own
    readiness is not awaited: provisioning rides through the moments before the meta leader
    is elected and waits while the cluster has too few peers for R3 (libs/bus/provision.py)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock,
        ):
            if sock.recv(4096).startswith(b"INFO"):
                return
        await asyncio.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:]
    raise AssertionError(f"nats-server on port {port} (exit {process.poll()}) is not up:\n{tail}")


def node_config(folder: Path) -> Path:
    """A copy of deploy/nats/ whose JetStream store is `folder/jetstream` (not /data)."""
    shutil.copytree(CLUSTER_CONF.parent, folder)
    nats_conf = folder / "nats.conf"
    store = folder / "jetstream"
    nats_conf.write_text(nats_conf.read_text().replace("store_dir: /data", f'store_dir: "{store}"'))
    assert str(store) in nats_conf.read_text(), "nats.conf no longer stores in /data"
    return folder / CLUSTER_CONF.name
