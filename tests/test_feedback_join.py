"""The join on a real nats-server, feedback posted over real HTTP to the running ingester:
either side late, not-eligible and missing generations dead-lettered, idempotent samples,
and pending state that survives a restart of the ingester."""

from __future__ import annotations

import asyncio
import random

from libs.bus import wire
from libs.bus.connection import Bus
from proto import streams
from proto.messages import DeadLetter, FeedbackEvent, OnlineSample
from tests.conftest import wait_for
from tests.feedback_support import (
    Ingester,
    auth,
    event_json,
    generation,
    publish_generation,
    running_ingester,
    stream_messages,
)

ONLINE = streams.ROLLOUTS_ONLINE.name
DEAD = streams.DEAD_LETTERS.name


async def samples(bus: Bus) -> list[OnlineSample]:
    return await stream_messages(bus.js, ONLINE, OnlineSample)


async def dead_letters(bus: Bus) -> list[DeadLetter]:
    return await stream_messages(bus.js, DEAD, DeadLetter)


async def post(ingester: Ingester, event_id: str, generation_id: str, **fields: object) -> None:
    body = event_json(event_id, generation_id, **fields)
    response = await ingester.client.post("/v1/feedback", json=body, headers=auth())
    assert response.status_code == 202, response.text


async def count(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


async def test_feedback_after_its_generation_becomes_an_online_sample(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        served = generation("gen-a")
        await publish_generation(bus, served)
        await wait_for(lambda: ingester.join.generations.num_handled == 1, what="indexed")
        await post(ingester, "ev-1", "gen-a", signal="thumbs_up")
        await wait_for(lambda: _has(bus, ONLINE, 1), what="a joined sample")
        [sample] = await samples(bus)
        assert sample.sample_id == "ev-1"
        assert sample.generation == served, "the exact served tokens and logprobs"
        assert (sample.feedback.event_id, sample.feedback.signal) == ("ev-1", "thumbs_up")
        raw = await bus.js.get_msg(ONLINE, seq=1)
        assert raw.headers and raw.headers[wire.MSG_ID_HEADER] == "ev-1"


async def test_feedback_before_its_generation_waits_for_it(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        await post(ingester, "ev-1", "gen-late", signal="rejected")
        await post(ingester, "ev-2", "gen-late", signal="edited", value=0.3)
        await wait_for(lambda: ingester.join.feedback.num_handled == 2, what="parked")
        await asyncio.sleep(0.5)  # several sweeps pass: nothing is joined or expired early
        assert await count(bus, ONLINE) == 0 and await count(bus, DEAD) == 0

        await publish_generation(bus, generation("gen-late"))
        await wait_for(lambda: _has(bus, ONLINE, 2), what="both events joined")
        joined = {s.sample_id: s for s in await samples(bus)}
        assert set(joined) == {"ev-1", "ev-2"}
        assert joined["ev-2"].feedback.value == 0.3
        assert all(s.generation.generation_id == "gen-late" for s in joined.values())


async def test_a_repeated_event_creates_one_sample(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        await publish_generation(bus, generation("gen-a"))
        for _ in range(3):
            await post(ingester, "ev-1", "gen-a")
        await post(ingester, "ev-2", "gen-a")
        await wait_for(lambda: _has(bus, ONLINE, 2), what="samples")
        await asyncio.sleep(0.3)
        assert sorted(s.sample_id for s in await samples(bus)) == ["ev-1", "ev-2"]


async def test_feedback_on_a_generation_not_eligible_is_dead_lettered(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        await post(ingester, "early", "gen-private")  # waits, then learns it is not eligible
        await wait_for(lambda: ingester.join.feedback.num_handled == 1, what="parked")
        await publish_generation(bus, generation("gen-private", eligible=False))
        await wait_for(lambda: ingester.join.generations.num_handled == 1, what="indexed")
        await post(ingester, "late", "gen-private")
        await wait_for(lambda: _has(bus, DEAD, 2), what="two dead letters")
        letters = {
            wire.decode(FeedbackEvent, d.payload, None).event_id: d for d in await dead_letters(bus)
        }
        assert set(letters) == {"early", "late"}
        for letter in letters.values():
            assert (
                letter.reason == "rejected" and letter.origin_stream == streams.FEEDBACK_EVENTS.name
            )
            assert letter.error.startswith("join: not_eligible:"), letter.error
        assert await count(bus, ONLINE) == 0


async def test_feedback_whose_generation_never_arrives_is_dead_lettered_after_the_window(
    bus: Bus,
) -> None:
    async with running_ingester(bus, join_window_s=1.0) as ingester:
        await post(ingester, "orphan", "gen-never")
        await wait_for(lambda: ingester.join.feedback.num_handled == 1, what="parked")
        assert await count(bus, DEAD) == 0
        await wait_for(lambda: _has(bus, DEAD, 1), timeout_s=10, what="expired")
        [letter] = await dead_letters(bus)
        assert letter.error.startswith("join: generation_missing: no generation gen-never")
        assert wire.decode(FeedbackEvent, letter.payload, None).event_id == "orphan"
        raw = await bus.js.get_msg(DEAD, seq=1)
        assert raw.headers and raw.headers[wire.DEAD_REASON_HEADER] == "rejected"
        # A generation arriving after the expiry finds nobody waiting.
        await publish_generation(bus, generation("gen-never"))
        await wait_for(lambda: ingester.join.generations.num_handled == 1, what="indexed")
        await asyncio.sleep(0.5)
        assert await count(bus, ONLINE) == 0 and await count(bus, DEAD) == 1


async def test_waiting_feedback_survives_a_restart_of_the_ingester(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        await post(ingester, "ev-1", "gen-r")
        await wait_for(lambda: ingester.join.feedback.num_handled == 1, what="parked")
    # Down: the generation arrives while nobody joins.
    await publish_generation(bus, generation("gen-r"))
    await publish_generation(bus, generation("gen-s"))
    async with running_ingester(bus) as ingester:
        await wait_for(lambda: _has(bus, ONLINE, 1), what="joined after the restart")
        await post(ingester, "ev-2", "gen-s")  # the index survived too
        await wait_for(lambda: _has(bus, ONLINE, 2), what="joined with an indexed generation")
        assert sorted(s.sample_id for s in await samples(bus)) == ["ev-1", "ev-2"]


async def test_expiry_waits_for_a_generation_backlog_after_a_restart(bus: Bus) -> None:
    async with running_ingester(bus, join_window_s=1.0) as ingester:
        await post(ingester, "ev-1", "gen-b")
        await wait_for(lambda: ingester.join.feedback.num_handled == 1, what="parked")
    await publish_generation(bus, generation("gen-b"))
    await asyncio.sleep(1.5)  # the event's window has passed while the joiner was down
    async with running_ingester(bus, join_window_s=1.0):
        await wait_for(lambda: _has(bus, ONLINE, 1), what="joined, not expired")
        await asyncio.sleep(0.5)
        assert await count(bus, DEAD) == 0


async def test_interleaved_generations_and_feedback_all_join_exactly_once(bus: Bus) -> None:
    async with running_ingester(bus, join_concurrency=32) as ingester:
        rng = random.Random(6)
        actions = [("gen", f"g{i}") for i in range(60)] + [("fb", f"g{i}") for i in range(60)]
        rng.shuffle(actions)

        async def act(kind: str, gid: str) -> None:
            if kind == "gen":
                await publish_generation(bus, generation(gid))
            else:
                await post(ingester, f"ev-{gid}", gid)

        await asyncio.gather(*(act(kind, gid) for kind, gid in actions))
        await wait_for(lambda: _has(bus, ONLINE, 60), timeout_s=30, what="60 samples")
        await asyncio.sleep(0.5)
        ids = [s.sample_id for s in await samples(bus)]
        assert sorted(ids) == sorted(f"ev-g{i}" for i in range(60))
        assert await count(bus, DEAD) == 0


async def _has(bus: Bus, stream: str, num: int) -> bool:
    return await count(bus, stream) >= num
