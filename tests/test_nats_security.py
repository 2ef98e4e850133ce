"""deploy/nats/auth.conf on a real nats-server: the feedback API's user can store feedback
events and read its own PubAcks, and nothing else; the running ingester works with it."""

from __future__ import annotations

import asyncio
import shutil
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
from libs.nats_server import NatsServer
from proto import streams, subjects
from proto.messages import FeedbackEvent
from services.feedback_ingester.service import FeedbackIngesterService
from tests.feedback_support import auth, event_json, settings

AUTH_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "auth.conf"
SERVICES_PASSWORD = "services-test-password"
FEEDBACK_PASSWORD = "feedback-test-password"
EVENT = FeedbackEvent(
    event_id="ev-1", generation_id="gen-1", product="acme", signal="accepted", occurred_at=1.0
)


class SecuredNatsServer(NatsServer):
    """The test server's own settings (port, store) plus the shipped auth.conf."""

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
        env.setenv("RLPIPE_NATS_SERVICES_PASSWORD", SERVICES_PASSWORD)
        env.setenv("RLPIPE_NATS_FEEDBACK_API_PASSWORD", FEEDBACK_PASSWORD)
        server = SecuredNatsServer(store_dir=tmp_path_factory.mktemp("nats-secured"))
        server.start()
    yield server
    server.stop()


@pytest.fixture
async def services_bus(secured_server: SecuredNatsServer) -> AsyncIterator[Bus]:
    bus = await connect_bus(secured_server.url_for("rlpipe", SERVICES_PASSWORD), name="admin")
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
        payload, headers = wire.encode(EVENT), wire.headers_for(EVENT, "x-1")
        for subject in (subjects.ROLLOUTS_ONLINE, subjects.SERVING_GENERATIONS, "rl.dead.x"):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await js.publish(subject, payload, headers=headers)
            await errors.wait_for(f'permissions violation for publish to "{subject}"')
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
    """role=api with api_nats_url: its publishes go through the feedback-only user."""
    service = FeedbackIngesterService(
        settings(
            role="api",
            api_nats_url=secured_server.url_for("feedback-api", FEEDBACK_PASSWORD),
        )
    )
    await service.start(services_bus)
    running = asyncio.create_task(service.run())
    try:
        assert service.api is not None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.api.port}") as client:
            response = await client.post("/v1/feedback", json=event_json("ev-9"), headers=auth())
        assert response.status_code == 202, response.text
    finally:
        await service.stop()
        await running
    raw = await services_bus.js.get_msg(streams.FEEDBACK_EVENTS.name, seq=1)
    assert raw.headers and raw.headers[wire.MSG_ID_HEADER] == "ev-9"
