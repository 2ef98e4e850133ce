"""A hub and one region on loopback, each nats-server running the shipped configs
(deploy/nats/hub.conf and region-leaf.conf with their includes, copied with this test's ports
and folders): the region links to the hub as its own identity, its relay mirrors the hub's
weight streams, its worker reads weights there and publishes rollouts on the hub as the
rollout-worker, and nobody in the region can publish on any hub subject.

Bus-level flows (raw messages on the weight and rollout subjects), not a training run: the
weight path through the mirrors is tests/test_weight_relay.py's.

Run: .venv/bin/python -m pytest tests/test_region_link.py -q
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import nats
import pytest

from libs.bus.connection import NatsOptions, connect_bus
from libs.bus.provision import provision
from libs.nats_server import NatsServer, free_port
from libs.weights.announcements import newest_policy_version
from libs.weights.relay import setup_relay
from proto import permissions, streams, subjects
from proto.permissions import REGION_ROLES, ROLES, password_variable
from tests.conftest import wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "nats"
HUB_PASSWORDS = {name: f"hub{name.replace('-', '')}Pw0" for name in ROLES}
REGION_PASSWORDS = {name: f"region{name.replace('-', '')}Pw0" for name in REGION_ROLES}
REGION = permissions.REGIONS[0]


@dataclass
class ShippedConfigServer(NatsServer):
    """A nats-server running a shipped config file (with its includes) copied beside its
    store, this test's ports and folder written over the container's."""

    shipped: str = "nats.conf"

    def write_config(self) -> Path:
        folder = self.store_dir / "config"
        shutil.copytree(DEPLOY, folder, dirs_exist_ok=True)
        for path in folder.glob("*.conf"):
            text = path.read_text()
            text = re.sub(r"^(\s*)store_dir:.*$", rf'\1store_dir: "{self.store_dir}/js"', text,
                          flags=re.M)  # fmt: skip
            text = re.sub(r"^port: 4222$", f"port: {self.port}", text, flags=re.M)
            text = re.sub(r"^http_port: 8222$", f"http_port: {self.monitor_port}", text, flags=re.M)
            text = re.sub(r"^(\s+)port: 7422$", rf"\1port: {self.leafnode_port}", text, flags=re.M)
            path.write_text(text)
        top = folder / self.shipped
        top.write_text(top.read_text() + '\nhost: "127.0.0.1"\n')
        return top


def hub_environment() -> dict[str, str]:
    return {ROLES[name].password_variable: pw for name, pw in HUB_PASSWORDS.items()}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, NatsServer]]:
    """The hub (hub.conf: every user, the leafnode listener, domain hub) and the region
    (region-leaf.conf: its own users, domain region-a, linked as leaf-region-a)."""
    leaf_port = free_port()
    hub = ShippedConfigServer(store_dir=tmp_path_factory.mktemp("hub"), shipped="hub.conf",
                              leafnode_port=leaf_port)  # fmt: skip
    region = ShippedConfigServer(
        store_dir=tmp_path_factory.mktemp("region"), shipped="region-leaf.conf"
    )
    leaf = f"leaf-{REGION}"
    leaf_url = f"nats-leaf://{leaf}:{HUB_PASSWORDS[leaf]}@127.0.0.1:{leaf_port}"
    with pytest.MonkeyPatch.context() as env:  # the configs read passwords from the environment
        for variable, value in hub_environment().items():
            env.setenv(variable, value)
        for name, value in REGION_PASSWORDS.items():
            env.setenv(password_variable(name, "region"), value)
        env.setenv("RLPIPE_NATS_LEAF_URL", leaf_url)
        hub.start()
        asyncio.run(provision_hub(hub))
        region.start()
    try:
        yield hub, region
    finally:
        region.stop()
        hub.stop()


async def provision_hub(hub: NatsServer) -> None:
    bus = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    try:
        await provision(bus.js)
    finally:
        await bus.close()


def hub_user(name: str) -> NatsOptions:
    return NatsOptions(user=name, password=HUB_PASSWORDS[name])


def region_user(name: str) -> NatsOptions:
    return NatsOptions(user=name, password=REGION_PASSWORDS[name])


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
    """Neither a regional user (its own permissions refuse it) nor the leaf identity itself,
    used as a client of the hub (the link's permissions refuse it): each publish is answered
    with a permissions violation, and the hub's streams and the trainer's state are untouched."""
    hub, region = servers
    await wait_for(lambda: bool(leaf_links(hub)), 30, "the region's leaf link")
    admin = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    before = {s.name: await messages(admin.js, s.name) for s in streams.ALL_STREAMS}
    leaf = f"leaf-{REGION}"
    users = [(region.url, name, REGION_PASSWORDS[name]) for name in REGION_ROLES]
    users.append((hub.url, leaf, HUB_PASSWORDS[leaf]))
    forged = (*HUB_SUBJECTS, f"$JS.{permissions.HUB_DOMAIN}.API.STREAM.DELETE.RL_TASKS")
    try:
        for url, user, password in users:
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
                    lambda errors=errors: (
                        sum("permissions violation" in e for e in errors)  # type: ignore[misc]
                        == len(forged)
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
