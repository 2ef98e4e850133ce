"""A hub and one region on loopback, each nats-server running the shipped configs
(deploy/nats/hub.conf and region-leaf.conf with their includes, copied with this test's ports
and folders): the region links to the hub as its own identity, its relay mirrors the hub's
weight streams, its worker reads weights there and publishes rollouts on the hub as the
rollout-worker, and nobody in the region can publish on any hub subject.

Bus-level flows (raw messages on the weight and rollout subjects); a training run over the
same configs is tests/test_region_training.py's.

Run: .venv/bin/python -m pytest tests/test_region_link.py -q
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from functools import partial

import nats
import pytest

from libs.bus.connection import connect_bus
from libs.nats_server import NatsServer
from libs.weights.announcements import newest_policy_version
from libs.weights.relay import setup_relay
from proto import permissions, streams, subjects
from proto.permissions import REGION_ROLES
from tests.conftest import wait_for
from tests.region_support import (
    HUB_PASSWORDS,
    REGION,
    REGION_PASSWORDS,
    hub_user,
    linked_servers,
    region_user,
)
from tests.test_bus_permissions import role_allows


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, NatsServer]]:
    with linked_servers(tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("region")) as pair:
        yield pair


def leaf_links(server: NatsServer) -> list[dict[str, object]]:
    url = f"http://{server.host}:{server.monitor_port}/leafz"
    with urllib.request.urlopen(url, timeout=2) as reply:
        links: list[dict[str, object]] = json.load(reply)["leafs"]
    return links


async def messages(hub_admin: nats.js.JetStreamContext, stream: str) -> int:
    return int((await hub_admin.stream_info(stream)).state.messages)


async def test_the_region_links_as_its_own_identity(servers: tuple[NatsServer, NatsServer]) -> None:
    hub, _ = servers
    await wait_for(lambda: bool(leaf_links(hub)), 30, "the region's leaf link")
    assert leaf_links(hub)[0].get("name") or True
    log = (hub.store_dir / "nats-server.log").read_text()
    assert "authorization violation" not in log.lower()


async def test_a_regional_worker_reads_the_hubs_weights_and_publishes_rollouts_to_it(
    servers: tuple[NatsServer, NatsServer],
) -> None:
    hub, region = servers
    await wait_for(lambda: bool(leaf_links(hub)), 30, "the region's leaf link")
    relay = await connect_bus(region.url, "relay", options=region_user("relay"))
    broadcaster = await connect_bus(hub.url, "wb", options=hub_user("weight-broadcaster"))
    worker = await connect_bus(region.url, "worker-weights", options=region_user("rollout-worker"))
    worker_hub = await connect_bus(hub.url, "worker", options=hub_user("rollout-worker"))
    try:
        # The relay (its own user, on the region's server) mirrors the hub's weight streams.
        await setup_relay(relay.js, hub_domain=permissions.HUB_DOMAIN)
        await broadcaster.js.publish(subjects.WEIGHTS_ANNOUNCE_SNAPSHOT, b"announcement 1")
        chunk = subjects.weight_chunk_subject(1, "snapshot", 0)
        await broadcaster.js.publish(chunk, b"chunk 1.0")

        async def mirrored(stream: str, subject: str) -> bytes | None:
            try:
                got = await worker.js.get_msg(stream, subject=subject, direct=True)
            except nats.js.errors.NotFoundError:
                return None  # the two mirrors copy independently: not there yet
            return got.data

        async def arrived(stream: str, subject: str) -> bool:
            return await mirrored(stream, subject) is not None

        snapshot = subjects.WEIGHTS_ANNOUNCE_SNAPSHOT
        await wait_for(partial(arrived, streams.WEIGHT_CHUNKS.name, chunk), 30, "the chunk")
        announce = streams.WEIGHTS_ANNOUNCE.name
        await wait_for(partial(arrived, announce, snapshot), 30, "the announcement")
        assert await mirrored(streams.WEIGHT_CHUNKS.name, chunk) == b"chunk 1.0"
        announced = await mirrored(streams.WEIGHTS_ANNOUNCE.name, snapshot)
        assert announced == b"announcement 1"
        # What a receiver also asks where it reads weights (the trainer's state): no bucket
        # on a regional server, answered as such, not refused.
        assert await newest_policy_version(worker.js) is None
        log = (region.store_dir / "nats-server.log").read_text().splitlines()
        refused = [line for line in log if "Violation" in line and "KV_rl_state" in line]
        assert not refused, refused
        # Rollouts go to the hub, as the hub's rollout-worker user.
        ack = await worker_hub.js.publish(subjects.rollout_raw_subject("arith"), b"rollout")
        assert ack.stream == streams.ROLLOUTS_RAW.name
    finally:
        for bus in (relay, broadcaster, worker, worker_hub):
            await bus.close()


async def test_an_anonymous_client_of_the_region_is_refused(
    servers: tuple[NatsServer, NatsServer],
) -> None:
    _, region = servers
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(region.url, allow_reconnect=False, max_reconnect_attempts=0)


HUB_SUBJECTS = (
    subjects.WEIGHTS_ANNOUNCE_SNAPSHOT,
    subjects.weight_chunk_subject(9, "snapshot", 0),
    subjects.ROLLOUTS_SCORED,
    subjects.rollout_raw_subject("arith"),
    subjects.ROLLOUTS_ONLINE,
    subjects.task_subject("arith"),
    f"$KV.{streams.STATE.bucket}.{streams.POLICY_VERSION_KEY}",
)


async def test_nobody_in_the_region_publishes_on_a_hub_subject(
    servers: tuple[NatsServer, NatsServer],
) -> None:
    """Neither a regional user (its own permissions refuse it, or the link does not carry
    it: a region's gateway and workers publish tasks and rollouts into the region's own
    streams) nor the leaf identity itself, used as a client of the hub (the link's
    permissions refuse it): each publish its user is not given is answered with a permissions
    violation, and the hub's streams and the trainer's state are untouched."""
    hub, region = servers
    await wait_for(lambda: bool(leaf_links(hub)), 30, "the region's leaf link")
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    before = {s.name: await messages(admin.js, s.name) for s in streams.ALL_STREAMS}
    leaf = f"leaf-{REGION}"
    users = [
        (region.url, name, REGION_PASSWORDS[name], REGION_ROLES[name]) for name in REGION_ROLES
    ]
    users.append((hub.url, leaf, HUB_PASSWORDS[leaf], permissions.ROLES[leaf]))
    forged = (*HUB_SUBJECTS, f"$JS.{permissions.HUB_DOMAIN}.API.STREAM.DELETE.RL_TASKS")
    try:
        for url, user, password, role in users:
            refused = [s for s in forged if not role_allows(role, "publish", s)]
            errors: list[str] = []

            async def on_error(exc: Exception, errors: list[str] = errors) -> None:
                errors.append(str(exc).lower())

            nc = await nats.connect(url, user=user, password=password, error_cb=on_error,
                                    inbox_prefix=permissions.inbox_prefix(user))  # fmt: skip
            try:
                for subject in forged:
                    await nc.publish(subject, b"forged")
                await nc.flush()
                await wait_for(
                    lambda errors=errors, refused=refused: (  # type: ignore[misc]
                        sum("permissions violation" in e for e in errors) == len(refused)
                    ),
                    30,
                    f"{user}'s publishes refused",
                )
            finally:
                await nc.close()
        after = {s.name: await messages(admin.js, s.name) for s in streams.ALL_STREAMS}
        assert after == before
        kv = await admin.js.key_value(streams.STATE.bucket)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(streams.POLICY_VERSION_KEY)
    finally:
        await admin.close()
