"""deploy/nats/auth.conf on a real nats-server: the feedback API's user can store feedback
events and read its own PubAcks, and nothing else; the ingester's API runs with that user
alone (role=api, provisioning off), in this process and as the real command compose runs.

Run: .venv/bin/python -m pytest tests/test_nats_security.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

from libs.bus import wire
from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.feedback.restricted_bus import DEFAULT_INBOX_PREFIX, connect_restricted_bus
from libs.nats_server import NatsServer, free_port
from proto import streams, subjects
from proto.messages import FeedbackEvent
from proto.permissions import ROLES
from services.feedback_ingester.service import FeedbackIngesterService
from services.feedback_ingester.settings import FeedbackIngesterSettings
from services.reward.settings import RewardSettings
from tests.feedback_support import ACME, auth, event_json, settings

AUTH_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "auth.conf"
SERVICES_PASSWORD = "admin-test-password"  # the admin's: provisioning, reading back
FEEDBACK_PASSWORD = "feedback-test-password"
EVENT = FeedbackEvent(
    event_id="ev-1", generation_id="gen-1", product="acme", signal="accepted", occurred_at=1.0
)


class SecuredNatsServer(NatsServer):
    """The test server's own settings (port, store) plus the shipped auth.conf (every
    role's user; tests/test_bus_permissions.py checks them all)."""

    def write_config(self) -> Path:
        config = super().write_config()
        shutil.copy(AUTH_CONF, self.store_dir / "auth.conf")
        config.write_text(config.read_text() + "include ./auth.conf\n")
        return config

    def url_for(self, user: str, password: str) -> str:
        return f"nats://{user}:{password}@{self.host}:{self.port}"


@pytest.fixture(scope="module")
def secured_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SecuredNatsServer]:
    with pytest.MonkeyPatch.context() as env:  # the config reads passwords from the environment
        for role in ROLES.values():  # every user of auth.conf needs its password
            env.setenv(role.password_variable, f"{role.name}-test-password")
        env.setenv("RLPIPE_NATS_ADMIN_PASSWORD", SERVICES_PASSWORD)
        env.setenv("RLPIPE_NATS_FEEDBACK_API_PASSWORD", FEEDBACK_PASSWORD)
        server = SecuredNatsServer(store_dir=tmp_path_factory.mktemp("nats-secured"))
        server.start()
    yield server
    server.stop()


@pytest.fixture
async def services_bus(secured_server: SecuredNatsServer) -> AsyncIterator[Bus]:
    bus = await connect_bus(secured_server.url_for("admin", SERVICES_PASSWORD), name="admin")
    for info in await bus.js.streams_info():
        assert info.config.name is not None
        await bus.js.delete_stream(info.config.name)
    await provision(bus.js)
    yield bus
    await bus.close()


class ErrorLog:
    """Errors the server sent to a client (nats-py reports them to error_cb)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc))

    async def wait_for(self, text: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text.lower() in e.lower() for e in self.errors):
            assert time.monotonic() < deadline, f"no error with {text!r}; got {self.errors}"
            await asyncio.sleep(0.02)


async def assert_publish_refused(nc: Client, errors: ErrorLog, subject: str) -> None:
    """The server refuses this client's publish to `subject`; the JetStream publish gets no ack."""
    js = nc.jetstream(timeout=1.0)
    payload, headers = wire.encode(EVENT), wire.headers_for(EVENT, f"refused-{subject}")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await js.publish(subject, payload, headers=headers)
    await errors.wait_for(f'permissions violation for publish to "{subject}"')


async def connect_feedback_user(server: SecuredNatsServer, errors: ErrorLog) -> Client:
    return await nats.connect(
        server.url_for("feedback-api", FEEDBACK_PASSWORD),
        inbox_prefix=DEFAULT_INBOX_PREFIX,
        error_cb=errors.on_error,
        allow_reconnect=False,
    )


async def test_the_feedback_user_stores_feedback_events(
    secured_server: SecuredNatsServer, services_bus: Bus
) -> None:
    bus = await connect_restricted_bus(
        secured_server.url_for("feedback-api", FEEDBACK_PASSWORD), "test-feedback-api"
    )
    try:
        ack = await Publisher(bus.js).publish(subjects.FEEDBACK_EVENTS, EVENT, msg_id="ev-1")
        assert ack.stream == streams.FEEDBACK_EVENTS.name and ack.seq == 1
    finally:
        await bus.close()
    raw = await services_bus.js.get_msg(streams.FEEDBACK_EVENTS.name, seq=1)
    assert wire.decode(FeedbackEvent, raw.data or b"", raw.headers) == EVENT


async def test_a_publish_anywhere_else_is_refused(
    secured_server: SecuredNatsServer, services_bus: Bus
) -> None:
    errors = ErrorLog()
    nc = await connect_feedback_user(secured_server, errors)
    try:
        js = nc.jetstream(timeout=1.0)
        for subject in (subjects.ROLLOUTS_ONLINE, subjects.SERVING_GENERATIONS, "rl.dead.x"):
            await assert_publish_refused(nc, errors, subject)
        # The JetStream API is closed to it: it cannot inspect or delete streams.
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.delete_stream(streams.FEEDBACK_EVENTS.name)
        await errors.wait_for('permissions violation for publish to "$JS.API.STREAM.DELETE.')
        # Nor can it listen to the bus or to other clients' replies.
        for subject in ("rl.>", "_INBOX.>"):
            await nc.subscribe(subject)
            await errors.wait_for(f'permissions violation for subscription to "{subject}"')
    finally:
        await nc.close()
    for stream in (streams.ROLLOUTS_ONLINE, streams.SERVING_GENERATIONS, streams.DEAD_LETTERS):
        assert (await services_bus.js.stream_info(stream.name)).state.messages == 0
    assert (await services_bus.js.stream_info(streams.FEEDBACK_EVENTS.name)).config is not None


async def test_a_wrong_password_is_refused(secured_server: SecuredNatsServer) -> None:
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(
            secured_server.url_for("feedback-api", "wrong"),
            allow_reconnect=False,
            max_reconnect_attempts=0,
        )


async def test_the_ingester_api_runs_with_only_the_feedback_user(
    secured_server: SecuredNatsServer, services_bus: Bus
) -> None:
    """role=api: both its connections (the service's and the API's) are the feedback user."""
    feedback_url = secured_server.url_for("feedback-api", FEEDBACK_PASSWORD)
    service_bus = await connect_bus(feedback_url, name="feedback-ingester")
    service = FeedbackIngesterService(
        settings(role="api", provision=False, api_nats_url=feedback_url)
    )
    await service.start(service_bus)
    running = asyncio.create_task(service.run())
    try:
        assert service.api is not None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.api.port}") as client:
            response = await client.post("/v1/feedback", json=event_json("ev-9"), headers=auth())
        assert response.status_code == 202, response.text
    finally:
        await service.stop()
        await running
        await service_bus.close()
    raw = await services_bus.js.get_msg(streams.FEEDBACK_EVENTS.name, seq=1)
    assert raw.headers and raw.headers[wire.MSG_ID_HEADER] == "ev-9"


async def wait_until_healthy(url: str, process: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1) as client:
        while True:
            assert process.poll() is None, f"the ingester exited with {process.returncode}"
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{url} did not answer 200 in {timeout_s} s"
            await asyncio.sleep(0.1)


async def test_the_ingester_command_runs_as_compose_runs_its_api_with_the_feedback_user_alone(
    secured_server: SecuredNatsServer, services_bus: Bus, tmp_path: Path
) -> None:
    """`rlpipe run feedback-ingester` with compose's feedback-api environment: role=api,
    provisioning off, no other credentials anywhere. It starts, stores a POSTed event (read
    back here as the admin), drains on SIGTERM, and never hit a permissions violation."""
    feedback_url = secured_server.url_for("feedback-api", FEEDBACK_PASSWORD)
    http_port, api_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {
        "RLPIPE_NATS_URL": feedback_url,
        "RLPIPE_FEEDBACK_INGESTER_ROLE": "api",
        "RLPIPE_FEEDBACK_INGESTER_PROVISION": "false",
        "RLPIPE_FEEDBACK_INGESTER_API_NATS_URL": feedback_url,
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": str(http_port),
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": str(api_port),
        "RLPIPE_FEEDBACK_INGESTER_API_KEYS": json.dumps([ACME.model_dump()]),
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_LOG_FORMAT": "json",
    }
    assert SERVICES_PASSWORD not in json.dumps(env)
    process = subprocess.Popen(
        [sys.executable, "-m", "apps.cli", "run", "feedback-ingester"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        await wait_until_healthy(f"http://127.0.0.1:{http_port}/healthz", process, timeout_s=120)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}") as client:
            response = await client.post("/v1/feedback", json=event_json("ev-7"), headers=auth())
        assert response.status_code == 202, response.text
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]

    raw = await services_bus.js.get_msg(streams.FEEDBACK_EVENTS.name, seq=1)
    stored = wire.decode(FeedbackEvent, raw.data or b"", raw.headers)
    assert stored.event_id == "ev-7" and stored.product == "acme"
    assert "permissions violation" not in stderr.lower(), stderr[-3000:]
    assert FEEDBACK_PASSWORD not in stderr, "a NATS password reached the logs"
    logged = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert logged[0]["settings"]["nats_url"].startswith("nats://feedback-api:***@")
    assert any(e.get("provisioned") == "skipped (provision off)" for e in logged)

    # The same credentials still cannot publish anywhere else.
    errors = ErrorLog()
    nc = await connect_feedback_user(secured_server, errors)
    try:
        await assert_publish_refused(nc, errors, subjects.ROLLOUTS_ONLINE)
    finally:
        await nc.close()
    assert (await services_bus.js.stream_info(streams.ROLLOUTS_ONLINE.name)).state.messages == 0


def test_provisioning_is_switched_per_service_or_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FeedbackIngesterSettings().provision, "services provision by default"
    monkeypatch.setenv("RLPIPE_PROVISION", "false")
    assert not FeedbackIngesterSettings().provision and not RewardSettings().provision
    monkeypatch.setenv("RLPIPE_FEEDBACK_INGESTER_PROVISION", "true")
    assert FeedbackIngesterSettings().provision, "the service's own variable wins"
    assert not RewardSettings().provision


def test_every_service_masks_passwords_in_its_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_NATS_URL", f"nats://rlpipe:{SERVICES_PASSWORD}@nats:4222")
    logged = RewardSettings().redacted()
    assert logged["nats_url"] == "nats://rlpipe:***@nats:4222"
    assert SERVICES_PASSWORD not in json.dumps(logged)
    ingester = FeedbackIngesterSettings(api_nats_url="nats://feedback-api:s3cret@nats:4222")
    assert ingester.redacted()["api_nats_url"] == "nats://feedback-api:***@nats:4222"


def test_provisioning_with_the_feedback_user_fails_naming_the_switch(
    secured_server: SecuredNatsServer, tmp_path: Path
) -> None:
    """Provisioning left on with a user that may not: exit 2 and one line naming the fix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {
        "RLPIPE_NATS_URL": secured_server.url_for("feedback-api", FEEDBACK_PASSWORD),
        "RLPIPE_FEEDBACK_INGESTER_ROLE": "api",
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": "0",
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": "0",
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_LOG_FORMAT": "json",
    }
    result = subprocess.run(
        [sys.executable, "-m", "apps.cli", "run", "feedback-ingester"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "RLPIPE_FEEDBACK_INGESTER_PROVISION=false" in result.stderr
    assert "Traceback" not in result.stderr and FEEDBACK_PASSWORD not in result.stderr
