"""Malformed input is refused the normal way by every decoder, deeply nested input included
(msgspec and json raise RecursionError on it, which is not a decode error): a dead letter
with its reason on the bus, against a real nats-server, and a 4xx counted in the API's
metrics over real HTTP (the feedback API's 422, serve mode's 400), never a 500 or a
message that vanishes after max_deliver.

Run: .venv/bin/python -m pytest tests/test_malformed_input.py -q
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client import REGISTRY

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.bus.stream_reader import StreamReader
from libs.domains.coding.grading import read_reports
from libs.domains.dataset.env import DatasetError, load_rows
from libs.sft.transcript import TranscriptError, parse_line
from proto.messages import Task
from tests.conftest import wait_for
from tests.feedback_support import auth, event_json, running_ingester
from tests.test_bus import STREAM, Recorder, dead_letters, run_consumer, setup_work, task
from tests.test_serve import (  # noqa: F401  # fixtures, used by name
    ServingFactory,
    assert_openai_error,
    engine,
    start_serving,
)

# A 400 KB body of `[[[[...`: far deeper than any decoder's recursion limit.
DEPTH = 400_000
NESTED_JSON = b"[" * DEPTH


def nested_task(depth: int = DEPTH) -> bytes:
    """A Task as msgpack whose opaque `spec` holds `depth` nested one-element arrays."""
    shallow = {"task_id": "deep", "env": "add", "prompt": "1+1=", "spec": {"x": None}}
    encoded = msgspec.msgpack.encode(shallow)
    return encoded.replace(b"\xa1x\xc0", b"\xa1x" + b"\x91" * depth + b"\xc0")


def requests_counted(name: str, route: str, status: str) -> float:
    return REGISTRY.get_sample_value(name, {"route": route, "status": status}) or 0.0


# --- the bus -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "reason", "says"),
    [
        (nested_task(), "undecodable", "nested deeper"),
        (b"\x91" * DEPTH + b"\xc0", "invalid", "Expected `object`"),
        (b"\xc1 not msgpack", "undecodable", "Task"),
        (nested_task(3)[:-9], "undecodable", "Task"),  # truncated
    ],
    ids=["nested-in-spec", "nested-at-top", "garbage", "truncated"],
)
def test_wire_decode_refuses_malformed_bytes_with_a_dead_letter_reason(
    data: bytes, reason: str, says: str
) -> None:
    with pytest.raises(wire.InvalidMessage) as refused:
        wire.decode(Task, data, None)
    assert refused.value.reason == reason
    assert says in str(refused.value)


async def test_a_deeply_nested_message_is_dead_lettered_at_once_and_the_consumer_goes_on(
    bus: Bus,
) -> None:
    spec = await setup_work(bus)
    publisher = Publisher(bus.js)
    await publisher.publish("test.work", task(1), msg_id="ok-1")
    await bus.js.publish("test.work", nested_task(), headers={wire.MSG_ID_HEADER: "deep"})
    await publisher.publish("test.work", task(2), msg_id="ok-2")

    handler = Recorder()
    consumer, running = await run_consumer(bus, spec, handler)
    try:
        await wait_for(lambda: len(handler.handled) == 2, what="the good messages around it")
        await wait_for(lambda: _has_letters(bus), what="the dead letter")
    finally:
        await consumer.stop()
        await running

    [(letter, headers)] = await dead_letters(bus)
    assert headers[wire.DEAD_REASON_HEADER] == "undecodable"
    assert "nested deeper" in headers[wire.DEAD_ERROR_HEADER]
    assert letter.payload == nested_task() and letter.headers[wire.MSG_ID_HEADER] == "deep"
    assert letter.num_delivered == 1, "dead-lettered on its first delivery, not after max_deliver"
    info = await bus.js.consumer_info(STREAM.name, spec.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_stream_reader_dead_letters_a_deeply_nested_message_and_reads_on(
    bus: Bus,
) -> None:
    await setup_work(bus)
    publisher = Publisher(bus.js)
    await publisher.publish("test.work", task(1), msg_id="ok-1")
    await bus.js.publish("test.work", nested_task(), headers={wire.MSG_ID_HEADER: "deep"})
    await publisher.publish("test.work", task(2), msg_id="ok-2")

    reader = StreamReader(bus.js, STREAM.name, "test.work", Task, publisher, reader_name="t")
    read = await reader.read(10, timeout_s=5.0)
    await reader.close()

    assert [r.message.task_id for r in read.records] == ["t1", "t2"]
    assert read.skipped == [2]
    [(letter, headers)] = await dead_letters(bus)
    assert headers[wire.DEAD_REASON_HEADER] == "undecodable"
    assert letter.stream_sequence == 2 and letter.payload == nested_task()


async def _has_letters(bus: Bus) -> bool:
    return (await bus.js.stream_info("TEST_DEAD")).state.messages > 0


# --- HTTP ----------------------------------------------------------------------------------


async def test_the_feedback_api_refuses_deeply_nested_bodies_with_422_and_counts_them(
    bus: Bus,
) -> None:
    name = "rlpipe_feedback_requests_total"
    before = {route: requests_counted(name, route, "422") for route in ("one", "batch")}
    in_a_field = event_json("ev-1")
    async with running_ingester(bus) as ingester:
        post = ingester.client.post
        one = await post("/v1/feedback", content=NESTED_JSON, headers=auth())
        batch = await post("/v1/feedback:batch", content=NESTED_JSON, headers=auth())
        in_a_field_body = msgspec.json.encode(in_a_field)[:-1] + b', "value": ' + NESTED_JSON
        field = await post("/v1/feedback", content=in_a_field_body + b"}", headers=auth())

    for response in (one, batch, field):
        assert response.status_code == 422, response.text
        [problem] = response.json()["detail"]
        assert problem["loc"] == ["body"] and problem["type"] == "json_invalid"
        assert "nested deeper" in problem["msg"]
    assert requests_counted(name, "one", "422") == before["one"] + 2
    assert requests_counted(name, "batch", "422") == before["batch"] + 1
    assert (await bus.js.stream_info("RL_FEEDBACK_EVENTS")).state.messages == 0


async def test_serve_mode_refuses_deeply_nested_bodies_with_400_and_counts_them(
    start_serving: ServingFactory,  # noqa: F811  # the fixture imported above
) -> None:
    serving = await start_serving()
    name = "rlpipe_serve_requests_total"
    before = {route: requests_counted(name, route, "400") for route in ("chat", "completions")}
    json_headers = {"content-type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = await serving.http.post(path, content=NESTED_JSON, headers=json_headers)
        assert_openai_error(response, 400)
        assert "not valid JSON" in response.json()["error"]["message"]
    assert requests_counted(name, "chat", "400") == before["chat"] + 1
    assert requests_counted(name, "completions", "400") == before["completions"] + 1


# --- files and what model code prints ------------------------------------------------------


def test_a_deeply_nested_report_line_from_agent_code_is_ignored() -> None:
    good = b'n0nce {"name": "case-1", "outcome": "value", "value": 3}'
    forged = b'n0nce {"name": "case-2", "value": ' + NESTED_JSON
    reports, ended = read_reports(b"\n".join([good, forged, b'n0nce {"end": true}']), "n0nce")
    assert list(reports) == ["case-1"] and ended


def test_a_deeply_nested_dataset_line_names_its_line(tmp_path: Path) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n' + NESTED_JSON + b"\n")
    with pytest.raises(DatasetError, match="line 2: not valid JSON"):
        load_rows(dataset)


def test_a_deeply_nested_transcript_line_names_its_line() -> None:
    with pytest.raises(TranscriptError, match="not valid JSON: nested deeper"):
        parse_line(NESTED_JSON.decode(), "demos.jsonl", 7)
