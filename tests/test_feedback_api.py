"""The feedback API over real HTTP (uvicorn on a free port, httpx) on a real nats-server:
durable 202s, idempotency, auth, malformed and oversized bodies, rate limits, the bus
going away, and SIGTERM reaching the service (not uvicorn) in the real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from libs.bus import wire
from libs.bus.connection import Bus
from libs.feedback.auth import KeyStore, hash_key, load_key_file
from libs.nats_server import NatsServer, free_port
from proto import streams
from proto.messages import FeedbackEvent
from services.feedback_ingester.settings import FeedbackIngesterSettings
from tests.feedback_support import (
    ACME,
    ACME_KEY,
    GLOBEX_KEY,
    auth,
    event_json,
    running_ingester,
    stream_messages,
)

FEEDBACK = streams.FEEDBACK_EVENTS.name


async def test_an_accepted_event_is_durable_in_the_stream_before_the_202(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        posted = event_json("ev-1", signal="edited", value=0.4)
        before = time.time()
        response = await ingester.client.post("/v1/feedback", json=posted, headers=auth())
        after = time.time()
        assert response.status_code == 202, response.text
        body = response.json()
        assert body["event_id"] == "ev-1" and body["stream_seq"] >= 1

        raw = await bus.js.get_msg(FEEDBACK, seq=body["stream_seq"])
        assert raw.headers and raw.headers[wire.MSG_ID_HEADER] == "ev-1"
        stored = wire.decode(FeedbackEvent, raw.data or b"", raw.headers)
        assert (stored.signal, stored.value, stored.user_hash) == ("edited", 0.4, "u-5f2c")
        assert before <= stored.received_at <= after, "the ingester stamps received_at"


async def test_a_repeated_event_gets_the_same_answer_and_is_stored_once(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        first = await ingester.client.post("/v1/feedback", json=event_json("ev-1"), headers=auth())
        # A client retry, even with a changed body, is the same event: first write wins.
        again = await ingester.client.post(
            "/v1/feedback", json=event_json("ev-1", signal="rejected"), headers=auth()
        )
        batch = await ingester.client.post(
            "/v1/feedback:batch",
            json={"events": [event_json("ev-1"), event_json("ev-2"), event_json("ev-2")]},
            headers=auth(),
        )
        assert first.status_code == again.status_code == 202
        assert again.content == first.content
        accepted = batch.json()["accepted"]
        assert accepted[0] == first.json()
        assert accepted[1] == accepted[2], "a repeat inside a batch is answered like the first"

        stored = await stream_messages(bus.js, FEEDBACK, FeedbackEvent)
        assert [(e.event_id, e.signal) for e in stored] == [
            ("ev-1", "accepted"),
            ("ev-2", "accepted"),
        ]


async def test_a_batch_is_stored_in_order_and_answered_in_order(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        events = [event_json(f"ev-{i}", signal="thumbs_up") for i in range(20)]
        response = await ingester.client.post(
            "/v1/feedback:batch", json={"events": events}, headers=auth()
        )
        assert response.status_code == 202, response.text
        accepted = response.json()["accepted"]
        assert [a["event_id"] for a in accepted] == [f"ev-{i}" for i in range(20)]
        seqs = [a["stream_seq"] for a in accepted]
        assert seqs == sorted(seqs) and len(set(seqs)) == 20
        assert len(await stream_messages(bus.js, FEEDBACK, FeedbackEvent)) == 20


async def test_requests_without_a_known_key_get_401_and_store_nothing(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        post = ingester.client.post
        missing = await post("/v1/feedback", json=event_json("ev-1"))
        unknown = await post("/v1/feedback", json=event_json("ev-1"), headers=auth("rlfb_nope"))
        wrong_scheme = await post(
            "/v1/feedback", json=event_json("ev-1"), headers={"Authorization": f"Basic {ACME_KEY}"}
        )
        for response in (missing, unknown, wrong_scheme):
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer" in response.json()["detail"]
        # Auth comes before the body is looked at: a bad body without a key is still a 401.
        assert (await post("/v1/feedback", content=b"{")).status_code == 401
        assert (await bus.js.stream_info(FEEDBACK)).state.messages == 0


async def test_a_key_posting_for_a_product_it_does_not_hold_gets_403(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        post = ingester.client.post
        other = await post(
            "/v1/feedback", json=event_json("ev-1", product="globex"), headers=auth()
        )
        assert other.status_code == 403
        assert "'acme-web' may not post feedback for product 'globex'" in other.json()["detail"]
        mixed = {"events": [event_json("ev-2"), event_json("ev-3", product="globex")]}
        assert (await post("/v1/feedback:batch", json=mixed, headers=auth())).status_code == 403
        assert (await bus.js.stream_info(FEEDBACK)).state.messages == 0, "all or nothing"
        # The globex key holds both products.
        allowed = await post("/v1/feedback:batch", json=mixed, headers=auth(GLOBEX_KEY))
        assert allowed.status_code == 202


async def test_malformed_bodies_get_422_naming_every_failing_field(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        post = ingester.client.post
        not_json = await post("/v1/feedback", content=b'{"event_id": ', headers=auth())
        assert not_json.status_code == 422
        assert not_json.json()["detail"][0]["loc"] == ["body"]
        assert "not valid JSON" in not_json.json()["detail"][0]["msg"]

        bad = event_json("ev-1", signal="meh", occurred_at="yesterday", value=1e12)
        del bad["generation_id"]
        response = await post("/v1/feedback", json=bad, headers=auth())
        assert response.status_code == 422
        problems = {tuple(d["loc"]): d for d in response.json()["detail"]}
        assert set(problems) == {
            ("body", "generation_id"),
            ("body", "signal"),
            ("body", "occurred_at"),
            ("body", "value"),
        }
        assert problems["body", "generation_id"]["type"] == "missing"
        assert "accepted" in problems["body", "signal"]["msg"], "says what is allowed"

        # An id must be safe as a Nats-Msg-Id header: no newline, even a trailing one.
        for event_id in ("ev-1\n", "ev 1", "", "x" * 129, "ev\r\nNats-Msg-Id: x"):
            response = await post("/v1/feedback", json=event_json(event_id), headers=auth())
            assert response.status_code == 422, event_id
            assert response.json()["detail"][0]["loc"] == ["body", "event_id"]

        batch = {"events": [event_json("ev-1"), {"event_id": 5}, "x", event_json("ev-3")]}
        response = await post("/v1/feedback:batch", json=batch, headers=auth())
        assert response.status_code == 422
        locs = [tuple(d["loc"][:3]) for d in response.json()["detail"]]
        assert ("body", "events", 1) in locs and ("body", "events", 2) in locs
        assert all(loc[2] in (1, 2) for loc in locs)

        empty_or_not_a_list: object
        for empty_or_not_a_list in ({"events": []}, {"events": {}}, {}, []):
            response = await post("/v1/feedback:batch", json=empty_or_not_a_list, headers=auth())
            assert response.status_code == 422, empty_or_not_a_list
        assert (await bus.js.stream_info(FEEDBACK)).state.messages == 0


async def test_bodies_over_the_limit_get_413_whether_declared_or_streamed(bus: Bus) -> None:
    async with running_ingester(bus, max_body_bytes=4096, max_batch_events=500) as ingester:
        events = {"events": [event_json(f"ev-{i}") for i in range(40)]}  # about 9 KB
        declared = await ingester.client.post("/v1/feedback:batch", json=events, headers=auth())
        assert declared.status_code == 413
        assert "4096 bytes" in declared.json()["detail"]

        async def chunks() -> AsyncIterator[
            bytes
        ]:  # no Content-Length: the limit must hold while reading
            for _ in range(10):
                yield b" " * 1024

        streamed = await ingester.client.post("/v1/feedback", content=chunks(), headers=auth())
        assert streamed.status_code == 413
        small = await ingester.client.post("/v1/feedback", json=event_json("ok"), headers=auth())
        assert small.status_code == 202


async def test_a_key_over_its_rate_gets_429_with_retry_after(bus: Bus) -> None:
    # A token back every 20 s: at 2 per second, six posts that took over half a second (a
    # loaded machine: each waits for its JetStream ack) got a token back and a 202.
    async with running_ingester(
        bus, rate_per_s=0.05, rate_burst_events=5, max_batch_events=5
    ) as ingester:
        post = ingester.client.post
        statuses = [
            (await post("/v1/feedback", json=event_json(f"ev-{i}"), headers=auth())).status_code
            for i in range(5)
        ]
        assert statuses == [202] * 5
        limited = await post("/v1/feedback", json=event_json("ev-5"), headers=auth())
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        assert "over its rate of 0.05 events/s" in limited.json()["detail"]
        # Another key has its own bucket.
        other = await post("/v1/feedback", json=event_json("ev-6"), headers=auth(GLOBEX_KEY))
        assert other.status_code == 202
        # A batch takes one token per event.
        batch = {"events": [event_json(f"g-{i}") for i in range(5)]}
        assert (
            await post("/v1/feedback:batch", json=batch, headers=auth(GLOBEX_KEY))
        ).status_code == 429
        assert (await bus.js.stream_info(FEEDBACK)).state.messages == 6


async def test_503_when_the_feedback_stream_cannot_store(bus: Bus) -> None:
    # role=api: the joiner's consumers would (rightly) fail loudly on a deleted stream.
    async with running_ingester(
        bus, role="api", publish_attempts=1, publish_timeout_s=0.5
    ) as ingester:
        await bus.js.delete_stream(FEEDBACK)  # nothing answers publishes on the subject now
        response = await ingester.client.post(
            "/v1/feedback", json=event_json("ev-1"), headers=auth()
        )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert "retry" in response.json()["detail"]


async def test_health_metrics_and_openapi_are_served(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        await ingester.client.post("/v1/feedback", json=event_json("ev-1"), headers=auth())
        health = await ingester.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "2 API keys" in health.json()["detail"]
        metrics = (await ingester.client.get("/metrics")).text
        assert 'rlpipe_feedback_requests_total{route="one",status="202"}' in metrics
        assert 'rlpipe_feedback_events_total{outcome="stored"}' in metrics
        document = (await ingester.client.get("/openapi.json")).json()
        assert set(document["paths"]) >= {"/v1/feedback", "/v1/feedback:batch", "/healthz"}
        event_schema = document["components"]["schemas"]["FeedbackEvent"]
        assert event_schema["properties"]["event_id"]["maxLength"] == 128, "proto's schema"
        post = document["paths"]["/v1/feedback"]["post"]
        assert set(post["responses"]) == {"202", "401", "403", "413", "422", "429", "503"}


def test_api_keys_load_from_a_secret_file_and_are_kept_hashed(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.toml"
    key_file.write_text(
        f'[[keys]]\nname = "acme-web"\nsha256 = "{hash_key(ACME_KEY)}"\nproducts = ["acme"]\n'
    )
    store = KeyStore(load_key_file(key_file))
    principal = store.authenticate(ACME_KEY)
    assert principal is not None and principal.may_post_for("acme")
    assert not principal.may_post_for("globex")
    assert store.authenticate(hash_key(ACME_KEY)) is None, "the stored hash is not a key"
    key_file.write_text('[[keys]]\nname = "x"\nsha256 = "not-hex"\nproducts = ["a"]\n')
    with pytest.raises(ValueError, match=r"keys\.toml"):
        load_key_file(key_file)


def test_settings_refuse_a_batch_larger_than_the_burst() -> None:
    with pytest.raises(ValueError, match="max_batch_events"):
        FeedbackIngesterSettings(max_batch_events=100, rate_burst_events=10)
    masked = FeedbackIngesterSettings(api_nats_url="nats://feedback-api:s3cret@nats:4222")
    assert masked.redacted()["api_nats_url"] == "nats://feedback-api:***@nats:4222"


def test_the_real_service_serves_and_drains_on_sigterm(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """SIGTERM must reach the service lifecycle (uvicorn must not take it and re-raise it)."""
    api_port = free_port()
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": str(free_port()),
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": str(api_port),
        "RLPIPE_FEEDBACK_INGESTER_API_KEYS": json.dumps([ACME.model_dump()]),
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_LOG_FORMAT": "json",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.feedback_ingester"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.1)
        response = httpx.post(
            f"{url}/v1/feedback", json=event_json("sig-1"), headers=auth(), timeout=10
        )
        assert response.status_code == 202, response.text
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert events[0]["settings"]["api_keys"] == "***", "keys are not logged"
    assert events[-1]["event"] == "service stopped"
    assert any(e["event"] == "stop requested; draining" for e in events)
