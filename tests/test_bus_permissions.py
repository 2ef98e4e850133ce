"""proto/permissions.py on a real nats-server: every role does its own job and is refused
everything else; the shipped auth.conf is what proto/ renders.

The server runs the users `render_authorization` makes (the same text as deploy/nats/auth.conf,
with passwords written in). Each check is one publish or subscription as one role, followed by
a sentinel publish every role is refused: the server answers in order, so an action was
allowed exactly when the sentinel's violation is the first one to come back.

Run: .venv/bin/python -m pytest tests/test_bus_permissions.py -q
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from apps.cli import main as rlpipe
from libs.bus import wire
from libs.bus.auth_config import render_authorization
from libs.bus.connection import NatsOptions, connect_bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.fleet.ledger import new_command, read_decisions, read_statuses, send_command
from libs.nats_server import NatsServer, find_nats_server
from proto import permissions, streams, subjects
from proto.fleet import (
    FleetCommand,
    FleetCommandReply,
    FleetDecision,
    ReplicaLoad,
    ReplicaStatus,
    fleet_command_subject,
)
from proto.fleet import replica_status_key as fleet_status_key
from proto.permissions import REGION_ROLES, ROLES, Role, password_variable

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "nats"
PASSWORDS = {name: f"test-{name}-password" for name in ROLES}
SENTINEL = "rl.permission-sentinel"
SERVICE_ROLES = [role for role in ROLES.values() if role.name != "admin"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = render_authorization(ROLES.values(), PASSWORDS)
    server = NatsServer(store_dir=tmp_path_factory.mktemp("nats-roles"), extra_config=config)
    server.start()
    asyncio.run(provision_as_admin(server))
    yield server
    server.stop()


async def provision_as_admin(server: NatsServer) -> None:
    """Streams, consumers and buckets made as the admin, once for the module."""
    bus = await connect_bus(server.url, "admin", options=_options("admin"))
    try:
        await provision(bus.js)
    finally:
        await bus.close()


def _options(role: str) -> NatsOptions:
    return NatsOptions(user=role, password=PASSWORDS[role])


class RoleClient:
    """A connection as one role that records the violations the server reports."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self._count = 0

    async def allowed(self, action: str, subject: str) -> bool:
        """True when the server accepts `action` ("publish" or "subscribe") on `subject`."""
        self.errors.clear()
        if action == "publish":
            await self.nc.publish(subject, b"")
        else:
            await self.nc.subscribe(subject)
        await self.nc.publish(SENTINEL, b"")
        await self.nc.flush()
        deadline = time.monotonic() + 30  # a hang guard: the sentinel's refusal always comes
        while not any(SENTINEL in e for e in self.errors):
            assert time.monotonic() < deadline, f"no answer to the sentinel; got {self.errors}"
            await asyncio.sleep(0.01)
        return not any(f'"{subject.lower()}"' in e for e in self.errors if SENTINEL not in e)


@pytest.fixture
async def connect(server: NatsServer) -> AsyncIterator[object]:
    clients: list[Client] = []

    async def as_role(role: str) -> RoleClient:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower().replace("'", '"'))

        nc = await nats.connect(
            server.url,
            user=role,
            password=PASSWORDS[role],
            inbox_prefix=permissions.inbox_prefix(role),
            error_cb=on_error,
            allow_reconnect=False,
        )
        clients.append(nc)
        return RoleClient(nc, errors)

    yield as_role
    for nc in clients:
        await nc.close()


def concrete(pattern: str) -> str:
    """A subject a pattern matches: `*` -> `x`, `>` -> `x.y`."""
    return ".".join("x" if t == "*" else "x.y" if t == ">" else t for t in pattern.split("."))


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching of one pattern against a concrete subject."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def role_allows(role: Role, action: str, subject: str) -> bool:
    patterns = role.publish if action == "publish" else role.subscribe
    return any(matches(p, subject) for p in patterns)


# --- the shipped file ----------------------------------------------------------------------


def test_the_shipped_auth_conf_is_what_proto_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert rlpipe(["nats-config", "render", "--check"]) == 0, capsys.readouterr().out


def test_a_stale_auth_conf_is_caught(tmp_path: Path) -> None:
    assert rlpipe(["nats-config", "render", "--dir", str(tmp_path)]) == 0
    assert rlpipe(["nats-config", "render", "--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "auth.conf").write_text("authorization { users = [] }\n")
    assert rlpipe(["nats-config", "render", "--check", "--dir", str(tmp_path)]) == 1


def test_every_service_has_a_role_and_every_role_its_own_inbox() -> None:
    from proto.services import SERVICES

    assert set(permissions.SERVICE_ROLES) == set(SERVICES)
    for role in [r for r in SERVICE_ROLES if r not in permissions.LEAF_ROLES]:
        assert role.subscribe[-1] == f"{role.inbox_prefix}.>"
        assert not any(matches(p, "_INBOX.x.y") for p in role.subscribe), role.name
        assert ">" not in role.publish and "$JS.API.>" not in role.publish, role.name


SHIPPED = ("nats.conf", "nats-secure.conf", "hub.conf", "cluster.conf", "region-leaf.conf")


def shipped_environment() -> dict[str, str]:
    """Every variable the shipped configs read, as a deployment sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {role.password_variable: f"{role.name.replace('-', '')}Pw0" for role in ROLES.values()}
    env |= {password_variable(n, "region"): f"{n.replace('-', '')}Pw0" for n in REGION_ROLES}
    env["RLPIPE_NATS_LEAF_URL"] = "nats-leaf://leaf-region-a:pw@hub.example.internal:7422"
    env["RLPIPE_NATS_NODE_NAME"] = "nats"
    return env


@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_config_validates(config: str) -> None:
    command = [find_nats_server(), "-t", "-c", str(DEPLOY / config)]
    done = subprocess.run(command, env=shipped_environment(), capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_server_without_a_users_password_refuses_to_start() -> None:
    env = shipped_environment()
    del env[ROLES["reward"].password_variable]
    command = [find_nats_server(), "-t", "-c", str(DEPLOY / "nats-secure.conf")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                          check=False)  # fmt: skip
    assert done.returncode != 0 and ROLES["reward"].password_variable in done.stderr


def test_security_md_tells_what_each_identity_may_do() -> None:
    text = (DEPLOY / "SECURITY.md").read_text()
    for role in [*ROLES, *REGION_ROLES]:
        assert f"| `{role}` |" in text, f"SECURITY.md does not name {role}"
    assert "Rotating a password" in text


# --- each role does its own job ------------------------------------------------------------


def own_actions(role: Role) -> list[tuple[str, str]]:
    """(action, subject) for every pattern `role` is allowed, made concrete."""
    return [
        (action, concrete(pattern))
        for action, patterns in (("publish", role.publish), ("subscribe", role.subscribe))
        for pattern in patterns
    ]


@pytest.mark.parametrize("role", [r.name for r in SERVICE_ROLES])
async def test_a_role_may_do_what_proto_gives_it(connect: object, role: str) -> None:
    client = await connect(role)  # type: ignore[operator]
    refused = [
        (action, subject)
        for action, subject in own_actions(ROLES[role])
        if not await client.allowed(action, subject)
    ]
    assert not refused, f"{role} was refused: {refused}"


# --- and nothing else ----------------------------------------------------------------------

# What a taken service could do harm with: forge weights, training data or decisions, rewrite
# the trainer's state, create or delete streams and consumers, read the whole bus.
SENSITIVE_PUBLISH = (
    subjects.WEIGHTS_ANNOUNCE_SNAPSHOT,
    subjects.WEIGHTS_ANNOUNCE_DELTA,
    subjects.weight_chunk_subject(7, "snapshot", 0),
    subjects.WEIGHTS_STAGED,
    subjects.ROLLOUTS_SCORED,
    subjects.rollout_raw_subject("arith"),
    subjects.ROLLOUTS_ONLINE,
    subjects.FEEDBACK_EVENTS,
    subjects.SERVING_GENERATIONS,
    subjects.task_subject("arith"),
    subjects.PROMOTIONS,
    subjects.env_op_subject("arith", "reset"),
    subjects.FLEET_DECISIONS,
    "rl.fleet.command.replica-2",
    f"$KV.{streams.FLEET.bucket}.replica.replica-2",
    f"$KV.{streams.STATE.bucket}.{streams.POLICY_VERSION_KEY}",
    f"$KV.{streams.STATE.bucket}.{streams.PROMOTED_VERSION_KEY}",
    f"$KV.{streams.STATE.bucket}.{streams.POLICY_IDENTITY_KEY}",
    f"$JS.API.STREAM.CREATE.{streams.ROLLOUTS_SCORED.name}",
    f"$JS.API.STREAM.UPDATE.{streams.WEIGHTS_ANNOUNCE.name}",
    *(f"$JS.API.STREAM.DELETE.{s.name}" for s in streams.ALL_STREAMS),
    f"$JS.API.STREAM.PURGE.{streams.ROLLOUTS_SCORED.name}",
    f"$JS.API.CONSUMER.DELETE.{streams.TASKS.name}.{streams.ROLLOUT_WORKER_TASKS.durable}",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{streams.TASKS.name}.stolen",
    f"$JS.API.STREAM.CREATE.KV_{streams.STATE.bucket}",
    "$JS.API.STREAM.LIST",
    "$JS.API.ACCOUNT.PURGE.x",
)
SENSITIVE_SUBSCRIBE = ("rl.>", "_INBOX.>", ">", "$KV.>", "_INBOX_trainer.>", "$JS.API.>")


def refusals(role: Role) -> list[tuple[str, str]]:
    """The sensitive actions `role` is not given."""
    return [
        (action, subject)
        for action, catalog in (("publish", SENSITIVE_PUBLISH), ("subscribe", SENSITIVE_SUBSCRIBE))
        for subject in catalog
        if not role_allows(role, action, subject)
    ]


@pytest.mark.parametrize("role", [r.name for r in SERVICE_ROLES])
async def test_a_role_is_refused_what_proto_does_not_give_it(connect: object, role: str) -> None:
    client = await connect(role)  # type: ignore[operator]
    actions = refusals(ROLES[role])
    assert actions, f"{role} may do every sensitive action"
    allowed = [(a, subject) for a, subject in actions if await client.allowed(a, subject)]
    assert not allowed, f"{role} may: {allowed}"


# The issue's cases, written out: the matrix above must refuse each of them.
MUST_REFUSE = (
    ("env-gateway", "publish", subjects.WEIGHTS_ANNOUNCE_SNAPSHOT),
    ("env-gateway", "publish", subjects.weight_chunk_subject(7, "snapshot", 0)),
    ("rollout-worker", "publish", subjects.ROLLOUTS_SCORED),
    ("rollout-worker", "publish", f"$KV.rl_state.{streams.POLICY_VERSION_KEY}"),
    ("feedback-api", "publish", subjects.ROLLOUTS_ONLINE),
    ("reward", "publish", f"$JS.API.STREAM.DELETE.{streams.ROLLOUTS_SCORED.name}"),
    ("serve-replica", "publish", f"$KV.rl_state.{streams.PROMOTED_VERSION_KEY}"),
    ("serve-replica", "publish", subjects.ROLLOUTS_ONLINE),
    ("trainer", "publish", f"$JS.API.STREAM.CREATE.{streams.ROLLOUTS_SCORED.name}"),
    ("trainer", "publish", subjects.WEIGHTS_ANNOUNCE_SNAPSHOT),
    ("weight-broadcaster", "publish", subjects.ROLLOUTS_SCORED),
    ("feedback-ingester", "publish", subjects.ROLLOUTS_SCORED),
    ("leaf-region-a", "publish", subjects.WEIGHTS_ANNOUNCE_DELTA),
    ("leaf-region-a", "publish", f"$JS.API.STREAM.DELETE.{streams.TASKS.name}"),
    ("reward", "subscribe", "_INBOX.>"),
    # The serving fleet: a replica neither decides nor commands another; the controller
    # touches no work, weights or state.
    ("lendable-replica", "publish", subjects.FLEET_DECISIONS),
    ("lendable-replica", "publish", "rl.fleet.command.replica-2"),
    ("lendable-replica", "publish", subjects.ROLLOUTS_SCORED),
    ("lendable-replica", "publish", f"$KV.rl_state.{streams.PROMOTED_VERSION_KEY}"),
    ("capacity-controller", "publish", subjects.task_subject("arith")),
    ("capacity-controller", "publish", f"$KV.{streams.FLEET.bucket}.replica.replica-2"),
    ("capacity-controller", "publish", subjects.WEIGHTS_ANNOUNCE_DELTA),
    ("serve-replica", "publish", f"$KV.{streams.FLEET.bucket}.replica.replica-2"),
)


def test_the_issues_cases_are_in_the_matrix() -> None:
    missing = [
        (role, action, subject)
        for role, action, subject in MUST_REFUSE
        if (action, subject) not in refusals(ROLES[role])
    ]
    assert not missing, f"proto/permissions.py allows: {missing}"


async def test_a_stream_delete_as_reward_leaves_the_stream(
    connect: object, server: NatsServer
) -> None:
    """Through the JetStream API as a client would call it: no answer, and the stream stays."""
    bus = await connect_bus(server.url, "reward", options=_options("reward"))
    admin = await connect_bus(server.url, "admin", options=_options("admin"))
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await bus.nc.jetstream(timeout=1.0).delete_stream(streams.ROLLOUTS_SCORED.name)
        assert (await admin.js.stream_info(streams.ROLLOUTS_SCORED.name)).config is not None
    finally:
        await bus.close()
        await admin.close()


async def test_the_controller_and_a_lendable_replica_talk_as_their_roles(
    server: NatsServer,
) -> None:
    """The fleet's exchange on the secured bus: the replica puts its status and answers a
    command to it; the controller reads the status, commands, and records its decision."""
    replica = await connect_bus(
        server.url, "lendable-replica", options=_options("lendable-replica")
    )
    controller = await connect_bus(
        server.url, "capacity-controller", options=_options("capacity-controller")
    )
    admin = await connect_bus(server.url, "admin", options=_options("admin"))
    try:
        status = ReplicaStatus(replica_id="replica-1", role="serving", ready=True,
                               load=ReplicaLoad(window_s=20.0), at=time.time())  # fmt: skip
        await (await replica.js.key_value(streams.FLEET.bucket)).put(
            fleet_status_key("replica-1"), wire.encode(status)
        )

        async def answer(msg: Msg) -> None:
            command = wire.decode(FleetCommand, msg.data, None)
            reply = FleetCommandReply(command_id=command.command_id, replica_id="replica-1",
                                      accepted=True, role="draining")  # fmt: skip
            await replica.nc.publish(msg.reply, wire.encode(reply))

        await replica.nc.subscribe(fleet_command_subject("replica-1"), cb=answer)
        assert [s.replica_id for s in await read_statuses(controller.js)] == ["replica-1"]
        command = new_command("replica-1", "lend", "off-peak", "capacity-controller")
        reply = await send_command(controller.nc, command)
        assert reply is not None and reply.accepted and reply.role == "draining"
        decision = FleetDecision(decision_id="d-1", action="lend", replica_id="replica-1",
                                 reason="off-peak", accepted=True)  # fmt: skip
        await Publisher(controller.js).publish(subjects.FLEET_DECISIONS, decision, "d-1")
        assert [d.decision_id for d in await read_decisions(admin.js)] == ["d-1"]
    finally:
        for bus in (replica, controller, admin):
            await bus.close()


def test_wildcard_matching_follows_nats() -> None:
    assert matches("rl.tasks.>", "rl.tasks.arith") and not matches("rl.tasks.>", "rl.tasks")
    assert matches("$KV.b.task_feeder.*", "$KV.b.task_feeder.arith")
    assert not matches("$KV.b.task_feeder.*", "$KV.b.task_feeder.a.b")
    assert re.fullmatch(r"[a-z.]+", concrete("rl.*.>")) and concrete("rl.*.>") == "rl.x.x.y"
