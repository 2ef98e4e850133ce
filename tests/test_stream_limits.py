"""Every stream and KV bucket of proto/ is bounded in size, and provisioning applies the
bounds to a bus provisioned before them, in place, keeping what it holds.

Run: .venv/bin/python -m pytest tests/test_stream_limits.py -q
"""

from __future__ import annotations

import msgspec

from libs.bus.connection import Bus
from libs.bus.provision import provision
from proto import streams
from tests.feedback_support import generation, publish_generation


def test_every_stream_and_bucket_has_a_size_bound() -> None:
    unbounded = [s.name for s in streams.ALL_STREAMS if s.max_bytes <= 0 and s.max_msgs <= 0]
    unbounded += [k.bucket for k in streams.ALL_KV if k.max_bytes <= 0]
    assert not unbounded, f"no max_bytes or max_msgs: {unbounded}"
    reserved = sum(s.max_bytes for s in streams.ALL_STREAMS if s.storage == "file")
    reserved += sum(k.max_bytes for k in streams.ALL_KV if k.storage == "file")
    assert reserved <= 8 * streams.GIB, "JetStream reserves these on the server's disk"


async def test_provisioning_bounds_a_bus_provisioned_before_the_limits(bus: Bus) -> None:
    unbounded_streams = tuple(
        msgspec.structs.replace(s, max_bytes=-1, max_msgs=-1, discard="old")
        for s in streams.ALL_STREAMS
    )
    unbounded_kv = tuple(
        msgspec.structs.replace(k, max_bytes=-1, direct=False) for k in streams.ALL_KV
    )
    await provision(bus.js, unbounded_streams, (), unbounded_kv)
    await publish_generation(bus, generation("gen-kept"))
    report = await provision(bus.js)
    assert all(report.outcomes[f"stream {s.name}"] == "updated" for s in streams.ALL_STREAMS), (
        report.outcomes
    )
    for spec in streams.ALL_STREAMS:
        config = (await bus.js.stream_info(spec.name)).config
        assert (config.max_bytes, config.max_msgs) == (spec.max_bytes, spec.max_msgs), spec.name
        assert getattr(config.discard, "value", config.discard) == spec.discard, spec.name
    for bucket in streams.ALL_KV:
        config = (await bus.js.stream_info(f"KV_{bucket.bucket}")).config
        assert (config.max_bytes, bool(config.allow_direct)) == (bucket.max_bytes, bucket.direct)
    kept = await bus.js.stream_info(streams.SERVING_GENERATIONS.name)
    assert kept.state.messages == 1, "nothing lost"
    assert (await provision(bus.js)).summary().endswith("unchanged")
