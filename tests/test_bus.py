"""The bus library against a real nats-server: durability, dedup, dead letters, redelivery."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.js.errors import APIError

from libs.bus import wire
from libs.bus.connection import Bus, BusConnectError, check_server_version, connect_bus
from libs.bus.consumer import DEFAULT_BACKOFF_S, Delivery, PermanentError, PullConsumer
from libs.bus.provision import (
    STORE_FAILED_ERR_CODE,
    ProvisionError,
    ensure_consumer,
    ensure_stream,
    provision,
    stream_config,
)
from libs.bus.publisher import Outgoing, Publisher, PublishError
from libs.nats_server import NatsServer, free_port
from proto import streams
from proto.messages import DeadLetter, Task
from proto.streams import ConsumerSpec, StreamSpec
from tests.conftest import wait_for

STREAM = StreamSpec(name="TEST_WORK", subjects=("test.work",), description="test stream")
DEAD = StreamSpec(name="TEST_DEAD", subjects=("rl.dead.>",), description="dead letters")


def consumer_spec(**overrides: object) -> ConsumerSpec:
    fields: dict[str, object] = {
        "stream": STREAM.name,
        "durable": "worker",
        "description": "test consumer",
        "ack_wait_s": 2.0,
        "max_deliver": 3,
    }
    fields.update(overrides)
    return ConsumerSpec(**fields)  # type: ignore[arg-type]


def task(n: int) -> Task:
    return Task(task_id=f"t{n}", env="add", prompt=f"{n}+{n}=")


async def setup_work(bus: Bus, spec: ConsumerSpec | None = None) -> ConsumerSpec:
    spec = spec or consumer_spec()
    await ensure_stream(bus.js, STREAM)
    await ensure_stream(bus.js, DEAD)
    await ensure_consumer(bus.js, spec)
    return spec


async def dead_letters(bus: Bus) -> list[tuple[DeadLetter, dict[str, str]]]:
    """Every dead letter stored so far, with its headers."""
    info = await bus.js.stream_info(DEAD.name)
    letters = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(DEAD.name, seq)
        letters.append(
            (msgspec.msgpack.decode(raw.data or b"", type=DeadLetter), dict(raw.headers or {}))
        )
    return letters


class Recorder:
    """A handler that records what it handled and can fail on chosen attempts."""

    def __init__(self, fail_first: set[str] = frozenset(), permanent: set[str] = frozenset()):  # type: ignore[assignment]
        self.handled: list[str] = []
        self.attempts: dict[str, int] = {}
        self.fail_first = fail_first
        self.permanent = permanent

    async def __call__(self, message: Task, delivery: Delivery) -> None:
        self.attempts[message.task_id] = self.attempts.get(message.task_id, 0) + 1
        if message.task_id in self.permanent:
            raise PermanentError("this task can never work")
        if message.task_id in self.fail_first and self.attempts[message.task_id] == 1:
            raise RuntimeError("transient failure")
        self.handled.append(message.task_id)


async def run_consumer(
    bus: Bus, spec: ConsumerSpec, handler: Recorder
) -> tuple[PullConsumer[Task], asyncio.Task[None]]:
    consumer = PullConsumer(
        bus.js, spec, Task, handler, Publisher(bus.js), fetch_timeout_s=0.2, backoff_s=(0.05, 0.1)
    )
    return consumer, asyncio.create_task(consumer.run())


async def test_message_survives_server_restart(bus: Bus, nats_server: NatsServer) -> None:
    spec = await setup_work(bus)
    await Publisher(bus.js).publish("test.work", task(1), msg_id="m-1")
    await bus.nc.close()

    nats_server.restart()

    fresh = await connect_bus(nats_server.url, name="after-restart")
    handler = Recorder()
    consumer, running = await run_consumer(fresh, spec, handler)
    await wait_for(lambda: handler.handled == ["t1"], what="the message stored before the restart")
    await consumer.stop()
    await running
    await fresh.nc.close()


async def test_retried_publish_with_same_id_is_stored_once(bus: Bus) -> None:
    spec = await setup_work(bus)
    publisher = Publisher(bus.js)
    first = await publisher.publish("test.work", task(1), msg_id="same-id")
    retry = await publisher.publish("test.work", task(1), msg_id="same-id")
    other = await publisher.publish("test.work", task(2), msg_id="other-id")

    assert retry.duplicate and retry.seq == first.seq
    assert not other.duplicate
    info = await bus.js.stream_info(STREAM.name)
    assert info.state.messages == 2

    handler = Recorder()
    consumer, running = await run_consumer(bus, spec, handler)
    await wait_for(lambda: len(handler.handled) == 2, what="both distinct messages")
    await consumer.stop()
    await running
    assert sorted(handler.handled) == ["t1", "t2"]


async def test_a_publish_rides_through_a_stream_that_answers_nobody_for_a_while(
    bus: Bus,
) -> None:
    """A stream electing a new leader answers "no responders" at once, for a while: five
    quick attempts (1.5 s of backoff) are not enough, the retry window is. Here the stream
    appears 1.5 s into the publish."""
    hasty = Publisher(bus.js, max_attempts=5, retry_window_s=0.0)
    with pytest.raises(PublishError, match="after 5 attempts"):
        await hasty.publish("test.work", task(1), msg_id="a")

    patient = Publisher(bus.js, max_attempts=5, retry_window_s=10.0)
    publishing = asyncio.create_task(patient.publish("test.work", task(1), msg_id="b"))
    await asyncio.sleep(1.5)
    assert not publishing.done(), "gave up before the window"
    await setup_work(bus)
    ack = await asyncio.wait_for(publishing, timeout=15)
    assert ack.stream == STREAM.name and ack.seq == 1


async def test_poison_message_is_dead_lettered_and_consumer_keeps_going(bus: Bus) -> None:
    spec = await setup_work(bus)
    publisher = Publisher(bus.js)
    await publisher.publish("test.work", task(1), msg_id="ok-1")
    await bus.js.publish("test.work", b"\xc1 not msgpack", headers={wire.MSG_ID_HEADER: "poison"})
    wrong_schema = msgspec.msgpack.encode({"task_id": 5})
    await bus.js.publish("test.work", wrong_schema, headers={wire.SCHEMA_HEADER: "task/1"})
    await publisher.publish("test.work", task(2), msg_id="ok-2")

    handler = Recorder()
    consumer, running = await run_consumer(bus, spec, handler)
    await wait_for(lambda: len(handler.handled) == 2, what="the good messages around the poison")
    letters = await dead_letters(bus)
    await consumer.stop()
    await running

    assert sorted(handler.handled) == ["t1", "t2"]
    reasons = sorted(h[wire.DEAD_REASON_HEADER] for _, h in letters)
    assert reasons == ["invalid", "undecodable"]
    for letter, headers in letters:
        assert headers[wire.DEAD_ORIGIN_HEADER] == f"{STREAM.name}/worker"
        assert letter.origin_subject == "test.work" and letter.consumer == "worker"
    undecodable = next(
        letter for letter, h in letters if h[wire.DEAD_REASON_HEADER] == "undecodable"
    )
    assert undecodable.payload == b"\xc1 not msgpack"
    assert (await bus.js.consumer_info(STREAM.name, "worker")).num_ack_pending == 0


async def test_crashed_handler_is_redelivered_and_handled_once(bus: Bus) -> None:
    spec = await setup_work(bus)
    await Publisher(bus.js).publish("test.work", task(1), msg_id="m-1")

    handler = Recorder(fail_first={"t1"})
    consumer, running = await run_consumer(bus, spec, handler)
    await wait_for(lambda: handler.handled == ["t1"], what="the redelivered message")
    # Longer than ack_wait: an unacked message would come back in this time.
    await asyncio.sleep(spec.ack_wait_s + 0.5)
    await consumer.stop()
    await running

    assert handler.attempts == {"t1": 2}
    assert handler.handled == ["t1"]
    info = await bus.js.consumer_info(STREAM.name, "worker")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_process_that_dies_mid_handler_loses_nothing(
    bus: Bus, nats_server: NatsServer
) -> None:
    spec = await setup_work(bus)
    await Publisher(bus.js).publish("test.work", task(1), msg_id="m-1")

    started = asyncio.Event()

    async def hangs(message: Task, delivery: Delivery) -> None:
        started.set()
        await asyncio.Event().wait()

    # The first "process": its connection dies while the handler is still working.
    doomed = await connect_bus(nats_server.url, name="doomed")
    consumer = PullConsumer(doomed.js, spec, Task, hangs, Publisher(doomed.js), fetch_timeout_s=0.2)
    running = asyncio.create_task(consumer.run())
    await asyncio.wait_for(started.wait(), timeout=10)
    running.cancel()
    await doomed.nc.close()

    handler = Recorder()
    survivor, survivor_running = await run_consumer(bus, spec, handler)
    await wait_for(
        lambda: handler.handled == ["t1"], timeout_s=spec.ack_wait_s + 10, what="redelivery"
    )
    await survivor.stop()
    await survivor_running


async def test_handler_failing_every_time_is_dead_lettered_after_max_deliver(bus: Bus) -> None:
    spec = await setup_work(bus)
    publisher = Publisher(bus.js)
    await publisher.publish("test.work", task(1), msg_id="bad")
    await publisher.publish("test.work", task(2), msg_id="rejected")
    await publisher.publish("test.work", task(3), msg_id="good")

    async def always_fails(message: Task, delivery: Delivery) -> None:
        if message.task_id == "t1":
            raise RuntimeError(f"attempt {delivery.num_delivered} failed")
        if message.task_id == "t2":
            raise PermanentError("not a valid task for this env")

    consumer = PullConsumer(
        bus.js, spec, Task, always_fails, publisher, fetch_timeout_s=0.2, backoff_s=(0.05,)
    )
    running = asyncio.create_task(consumer.run())

    async def two_letters() -> bool:
        try:
            return len(await dead_letters(bus)) == 2
        except Exception:
            return False

    await wait_for(two_letters, what="two dead letters")
    await consumer.stop()
    await running
    by_reason = {h[wire.DEAD_REASON_HEADER]: letter for letter, h in await dead_letters(bus)}
    assert by_reason["max_deliver"].num_delivered == spec.max_deliver
    assert "attempt 3 failed" in by_reason["max_deliver"].error
    assert by_reason["rejected"].num_delivered == 1
    info = await bus.js.consumer_info(STREAM.name, "worker")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_stop_lets_in_flight_handler_finish_and_ack(bus: Bus) -> None:
    spec = await setup_work(bus)
    await Publisher(bus.js).publish("test.work", task(1), msg_id="m-1")
    started, release = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def slow(message: Task, delivery: Delivery) -> None:
        started.set()
        await release.wait()
        finished.append(message.task_id)

    consumer = PullConsumer(bus.js, spec, Task, slow, Publisher(bus.js), fetch_timeout_s=0.2)
    running = asyncio.create_task(consumer.run())
    await asyncio.wait_for(started.wait(), timeout=10)
    stopping = asyncio.create_task(consumer.stop(grace_s=5))
    release.set()
    await stopping
    await running
    assert finished == ["t1"]
    await wait_for(lambda: _no_ack_pending(bus), what="the drained message to be acked")


async def _no_ack_pending(bus: Bus) -> bool:
    info = await bus.js.consumer_info(STREAM.name, "worker")
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_publish_many_pipelines_and_stores_every_message(bus: Bus) -> None:
    await setup_work(bus)
    publisher = Publisher(bus.js, max_in_flight=8)
    acks = await publisher.publish_many(
        Outgoing("test.work", task(n), msg_id=f"m-{n}") for n in range(200)
    )
    assert [a.seq for a in acks] == list(range(1, 201))
    assert (await bus.js.stream_info(STREAM.name)).state.messages == 200


async def test_provisioning_twice_changes_nothing(bus: Bus) -> None:
    first = await provision(bus.js)
    second = await provision(bus.js)
    assert set(first.outcomes.values()) == {"created"}
    assert set(second.outcomes.values()) == {"unchanged"}
    assert len(first.outcomes) == len(streams.ALL_STREAMS) + len(streams.ALL_CONSUMERS) + len(
        streams.ALL_KV
    )


async def test_a_stream_whose_store_could_not_be_made_is_created_by_the_next_attempt(
    bus: Bus, nats_server: NatsServer
) -> None:
    await ensure_stream(bus.js, STREAM)  # the account's streams folder exists from here
    streams_folder = next(nats_server.store_dir.rglob("streams"))
    blocked = StreamSpec(name="BLOCKED", subjects=("blocked.>",), description="x")
    # A file where the store folder goes: the server fails the create (and clears the path).
    (streams_folder / "BLOCKED").write_text("in the way")
    with pytest.raises(APIError) as refused:
        await bus.js.add_stream(config=stream_config(blocked))
    assert refused.value.err_code == STORE_FAILED_ERR_CODE
    (streams_folder / "BLOCKED").write_text("in the way")  # again: ensure_stream tries twice
    assert await ensure_stream(bus.js, blocked) == "created"
    assert (await bus.js.stream_info("BLOCKED")).config.subjects == ["blocked.>"]


async def test_changed_definition_is_updated_or_refused(bus: Bus) -> None:
    await ensure_stream(bus.js, STREAM)
    longer = StreamSpec(
        name=STREAM.name, subjects=STREAM.subjects, description="x", max_age_s=600.0
    )
    assert await ensure_stream(bus.js, longer) == "updated"
    assert (await bus.js.stream_info(STREAM.name)).config.max_age == 600.0

    as_work_queue = StreamSpec(
        name=STREAM.name,
        subjects=STREAM.subjects,
        description="x",
        max_age_s=600.0,
        retention="workqueue",
    )
    with pytest.raises(ProvisionError, match="retention"):
        await ensure_stream(bus.js, as_work_queue)

    spec = consumer_spec()
    await ensure_consumer(bus.js, spec)
    assert await ensure_consumer(bus.js, consumer_spec(max_deliver=7)) == "updated"
    assert (await bus.js.consumer_info(STREAM.name, "worker")).config.max_deliver == 8


async def test_connect_to_nothing_fails_fast_with_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(BusConnectError, match=url.replace(".", r"\.")):
        await connect_bus(
            url, name="nobody-home", max_attempts=2, retry_delay_s=0.05, connect_timeout_s=0.5
        )


def test_old_server_is_refused_with_the_reason() -> None:
    with pytest.raises(BusConnectError, match=r"needs >= 2\.11\.0.*batch direct get"):
        check_server_version("2.9.10", "nats://example:4222")
    check_server_version("2.11.0", "nats://example:4222")


def test_a_redelivered_message_is_republished_inside_the_duplicate_window() -> None:
    # The longest a consumer can take to hand a message out again: every attempt waiting out
    # its ack_wait plus the longest nak delay. A handler that published and died before its
    # ack republishes with the same id within that time, so the copy must be dropped.
    worst_redelivery_s = max(
        spec.max_deliver * (spec.ack_wait_s + max(DEFAULT_BACKOFF_S))
        for spec in streams.ALL_CONSUMERS
    )
    for stream in streams.ALL_STREAMS:
        assert stream.duplicate_window_s > worst_redelivery_s, stream.name
    assert all(spec.ack_wait_s <= streams.MAX_ACK_WAIT_S for spec in streams.ALL_CONSUMERS)
