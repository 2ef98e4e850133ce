"""What a leaked feedback key can do, bounded: on a real nats-server, feedback posted over real
HTTP to the running ingester.

- per-generation and per-key caps on what becomes training data (the rest stays stored);
- every stored event names its key; a key rates only its own products' generations;
- the rate limit is one per key across replicas (on the bus);
- the join's per-id state is appended, one small key per event, each key with a TTL;
- a purge by key removes its events from the stream, the join store, the online samples
  and the dead letters, and nothing of another key's.

Run: .venv/bin/python -m pytest tests/test_feedback_caps.py -q
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.feedback.auth import key_id
from libs.feedback.join import BUCKET
from libs.feedback.join_store import GEN_PREFIX, WAIT_PREFIX, GenerationRef
from libs.feedback.kv_state import KvKeys
from libs.feedback.purge import KeySelector, find_key_events
from libs.feedback.rate_limit import SharedTokenBucket
from libs.nats_server import NatsServer
from proto import streams
from proto.messages import GENERATION_PRODUCT_KEY, DeadLetter, FeedbackEvent, OnlineSample
from tests.conftest import wait_for
from tests.feedback_support import (
    ACME,
    GLOBEX,
    GLOBEX_KEY,
    Ingester,
    auth,
    event_json,
    generation,
    publish_generation,
    running_ingester,
    stream_messages,
)

FEEDBACK = streams.FEEDBACK_EVENTS.name
ONLINE = streams.ROLLOUTS_ONLINE.name
DEAD = streams.DEAD_LETTERS.name
UNLIMITED = {"rate_per_s": 1e6, "rate_burst_events": 1_000_000}


async def post_batch(ingester: Ingester, events: list[dict[str, Any]], key: str = "") -> None:
    for start in range(0, len(events), 500):
        body = {"events": events[start : start + 500]}
        headers = auth(key) if key else auth()
        response = await ingester.client.post("/v1/feedback:batch", json=body, headers=headers)
        assert response.status_code == 202, response.text


async def samples(bus: Bus) -> list[OnlineSample]:
    return await stream_messages(bus.js, ONLINE, OnlineSample)


async def count(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


def handled(ingester: Ingester, num: int) -> Any:
    return lambda: ingester.join.feedback.num_handled >= num


async def test_ten_thousand_events_on_one_generation_become_at_most_the_cap(bus: Bus) -> None:
    async with running_ingester(bus, **UNLIMITED) as ingester:
        cap = ingester.join.joiner.config.generation_sample_cap
        others = [f"g-{i}" for i in range(200)]
        for gid in others:
            await publish_generation(bus, generation(gid))
        # Half the flood waits for its generation, beside ordinary feedback on other ids.
        hot = [event_json(f"hot-{i}", "gen-hot") for i in range(5000)]
        ordinary = [event_json(f"ev-{gid}-{n}", gid) for gid in others for n in range(2)]
        await post_batch(ingester, hot + ordinary)
        await wait_for(handled(ingester, 5400), what="the first half handled")
        await publish_generation(bus, generation("gen-hot"))
        await post_batch(ingester, [event_json(f"hot-{i}", "gen-hot") for i in range(5000, 10000)])
        await wait_for(handled(ingester, 10400), what="all handled")
        await wait_for(lambda: ingester.join.generations.num_handled == 201, what="indexed")

        joined = await samples(bus)
        from_hot = [s for s in joined if s.generation.generation_id == "gen-hot"]
        assert len(from_hot) == cap, "at most the cap of one generation's events train"
        assert sorted(s.sample_id for s in joined if s not in from_hot) == sorted(
            e["event_id"] for e in ordinary
        ), "every event on another id joined"
        # Counted as capped (an event both its own handler and the flush resolved: twice).
        assert ingester.join.joiner.num_capped >= 10000 - cap
        assert await count(bus, FEEDBACK) == 10400, "capped events stay stored as feedback"
        assert await count(bus, DEAD) == 0
        # The id's state stays small: its index lists the admitted ids, nothing waits.
        store = ingester.join.joiner.store
        indexed = await store.generation("gen-hot")
        assert indexed is not None and len(indexed.ref.sampled) == cap
        assert [item async for item in store.waiting("gen-hot")] == []


async def test_a_keys_training_samples_stop_at_its_budget(bus: Bus) -> None:
    async with running_ingester(bus, join_key_sample_cap=3, **UNLIMITED) as ingester:
        for i in range(6):
            await publish_generation(bus, generation(f"g-{i}"))
        await post_batch(ingester, [event_json(f"a-{i}", f"g-{i}") for i in range(6)])
        await post_batch(ingester, [event_json(f"b-{i}", f"g-{i}") for i in range(2)], GLOBEX_KEY)
        await wait_for(handled(ingester, 8), what="handled")
        await wait_for(lambda: _has(bus, ONLINE, 5), what="samples")
        by_key = [s.feedback.key_name for s in await samples(bus)]
        assert sorted(by_key) == ["acme-web"] * 3 + ["globex"] * 2, "3 of acme's 6, globex's own"
        assert ingester.join.joiner.num_capped == 3
        assert await count(bus, FEEDBACK) == 8


async def test_every_stored_event_names_the_key_that_sent_it(bus: Bus) -> None:
    async with running_ingester(bus, role="api") as ingester:
        forged = event_json("ev-1", key_name="someone-else", key_id="000000000000")
        await post_batch(ingester, [forged])
        await post_batch(ingester, [event_json("ev-2")], GLOBEX_KEY)
    stored = await stream_messages(bus.js, FEEDBACK, FeedbackEvent)
    assert [(e.event_id, e.key_name, e.key_id) for e in stored] == [
        ("ev-1", "acme-web", key_id(ACME.sha256)),
        ("ev-2", "globex", key_id(GLOBEX.sha256)),
    ], "the ingester's stamp, whatever the client sent"


async def test_a_key_cannot_rate_another_products_generation(bus: Bus) -> None:
    async with running_ingester(bus) as ingester:
        served = msgspec.structs.replace(
            generation("gen-g"), metadata={GENERATION_PRODUCT_KEY: "globex"}
        )
        await publish_generation(bus, served)
        await post_batch(ingester, [event_json("acme-on-globex", "gen-g")])  # product acme
        own = event_json("globex-own", "gen-g", product="globex")
        await post_batch(ingester, [own], GLOBEX_KEY)
        await wait_for(handled(ingester, 2), what="handled")
        await wait_for(lambda: _has(bus, DEAD, 1), what="a dead letter")
        [letter] = await stream_messages(bus.js, DEAD, DeadLetter)
        assert letter.error.startswith("join: wrong_product: generation gen-g was served for")
        await wait_for(lambda: _has(bus, ONLINE, 1), what="the product's own sample")
        assert [s.sample_id for s in await samples(bus)] == ["globex-own"]


async def test_the_rate_limit_is_shared_by_two_replicas(bus: Bus) -> None:
    limits = {"rate_per_s": 0.01, "rate_burst_events": 4, "max_batch_events": 4, "role": "api"}
    async with running_ingester(bus, **limits) as first, running_ingester(bus, **limits) as second:
        statuses = []
        for i in range(8):
            replica = (first, second)[i % 2]
            body = event_json(f"ev-{i}")
            response = await replica.client.post("/v1/feedback", json=body, headers=auth())
            statuses.append(response.status_code)
    assert statuses.count(202) == 4 and statuses.count(429) == 4, statuses
    assert await count(bus, FEEDBACK) == 4


async def test_replicas_buckets_never_grant_more_than_the_shared_one(bus: Bus) -> None:
    await provision(bus.js)
    now = [1000.0]
    bucket = streams.FEEDBACK_RATE.bucket
    keys = KvKeys(bus.js, await bus.js.key_value(bucket), streams.FEEDBACK_RATE)

    def replica() -> SharedTokenBucket:
        return SharedTokenBucket(
            keys, "rate", rate_per_s=10, burst=10, lease=5, clock=lambda: now[0]
        )

    a, b = replica(), replica()
    granted = [await r.take("k") for r in (a, b)]  # each leases 5 of the 10
    granted += [await r.take("k") for r in (a, b) for _ in range(4)]
    assert granted == [0.0] * 10
    assert await a.take("k") == pytest.approx(0.1), "empty: a token comes back in 0.1 s"
    assert await b.take("k", 2) == pytest.approx(0.2)
    now[0] += 0.5  # 5 tokens back, shared: the first replica to ask leases them
    assert [await a.take("k") for _ in range(3)] == [0.0] * 3
    assert await b.take("k", 3) == pytest.approx(0.3), "a holds the other 2"
    assert await a.take("k", 2) == 0.0
    assert await a.take("k") > 0 and await b.take("k") > 0, "15 granted: 10 + 10/s * 0.5 s"
    assert await a.take("k", 11) == float("inf"), "more than the burst never fits"


async def test_join_state_is_one_key_per_event_and_every_key_expires(bus: Bus) -> None:
    async with running_ingester(bus, join_window_s=600.0) as ingester:
        await post_batch(ingester, [event_json(f"ev-{i}", "gen-w") for i in range(3)])
        await wait_for(handled(ingester, 3), what="parked")
        await publish_generation(bus, generation("gen-i"))
        await wait_for(lambda: ingester.join.generations.num_handled == 1, what="indexed")
        kv_stream = f"KV_{BUCKET}"
        waiting = await bus.js.stream_info(kv_stream, subjects_filter=f"$KV.{BUCKET}.wait.>")
        assert sorted(waiting.state.subjects or {}) == [
            f"$KV.{BUCKET}.{WAIT_PREFIX}gen-w.ev-{i}" for i in range(3)
        ]
        for key, ttl_s in ((f"{WAIT_PREFIX}gen-w.ev-0", 600 + 86400), (f"{GEN_PREFIX}gen-i", 600)):
            raw = await bus.js.get_msg(kv_stream, subject=f"$KV.{BUCKET}.{key}")
            assert raw.headers and raw.headers["Nats-TTL"] == str(ttl_s), key
        stored = await bus.js.get_msg(kv_stream, subject=f"$KV.{BUCKET}.{GEN_PREFIX}gen-i")
        assert msgspec.msgpack.decode(stored.data or b"", type=GenerationRef).sampled == []


async def test_a_purge_by_key_removes_its_events_everywhere(
    bus: Bus, nats_server: NatsServer
) -> None:
    async with running_ingester(bus) as ingester:
        await publish_generation(bus, generation("gen-p"))
        await publish_generation(bus, generation("gen-x", eligible=False))
        await wait_for(lambda: ingester.join.generations.num_handled == 2, what="indexed")
        acme = [event_json("a-1", "gen-p"), event_json("a-2", "gen-x"), event_json("a-3", "gen-w")]
        await post_batch(ingester, acme)
        globex = [event_json("g-1", "gen-p"), event_json("g-2", "gen-w")]
        await post_batch(ingester, globex, GLOBEX_KEY)
        await wait_for(handled(ingester, 5), what="handled")
        await wait_for(lambda: _has(bus, ONLINE, 2), what="samples")
        await wait_for(lambda: _has(bus, DEAD, 1), what="a dead letter")

        listed = await rlpipe("list", "acme-web", nats_server.url)
        assert "found 6 stored copies" in listed and "events        3" in listed, listed
        purged = await rlpipe("purge", f"acme-web:{key_id(ACME.sha256)}", nats_server.url)
        assert "deleted 6 stored copies" in purged, purged

        left = await find_key_events(bus.js, KeySelector("acme-web"))
        assert left.total == 0, left.counts()
        kept = await find_key_events(bus.js, KeySelector("globex"))
        assert kept.counts() == {"events": 2, "waiting": 1, "samples": 1, "dead_letters": 0}
        # The purged event no longer waits: its generation brings globex's alone.
        await publish_generation(bus, generation("gen-w"))
        await wait_for(lambda: _has(bus, ONLINE, 2), what="globex's waiting event joined")
        assert sorted(s.sample_id for s in await samples(bus)) == ["g-1", "g-2"]
        assert [e.event_id for e in await stream_messages(bus.js, FEEDBACK, FeedbackEvent)] == [
            "g-1",
            "g-2",
        ]


async def rlpipe(action: str, key: str, url: str) -> str:
    """`rlpipe feedback-events ACTION --key KEY` as a user runs it."""
    command = [sys.executable, "-m", "apps.cli", "feedback-events", action, "--key", key]
    result = await asyncio.to_thread(
        subprocess.run, [*command, "--nats-url", url], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


async def _has(bus: Bus, stream: str, num: int) -> bool:
    return await count(bus, stream) >= num
