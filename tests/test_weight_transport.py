"""Weight chunks on a real nats-server: stored once, fetched in parallel, verified, and a
corrupt or missing chunk refuses the version instead of reaching a model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.weights import CorruptDeltaError, EncodeOptions, MissingChunkError, decode, encode
from libs.weights.encoder import encode_snapshot
from libs.weights.format import encode_chunk
from libs.weights.tensors import RawTensor
from libs.weights.transport import (
    CHUNK_LEADER_READS,
    CHUNK_REFETCHES,
    chunk_subject,
    fetch_chunks,
    store_chunks,
)
from proto import streams

SMALL = EncodeOptions(max_chunk_bytes=16 << 10)


def random_state(seed: int, numel: int = 40_000) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {
        "w.bf16": RawTensor("BF16", (numel // 100, 100), rng.integers(0, 256, numel * 2, np.uint8)),
        "b.f32": RawTensor("F32", (numel // 10,), rng.integers(0, 256, numel // 10 * 4, np.uint8)),
    }


def changed(state: dict[str, RawTensor], seed: int, fraction: float = 0.03) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in state.items():
        units = tensor.units().copy()
        picked = rng.random(units.size) < fraction
        units[picked] ^= 1
        out[name] = RawTensor(tensor.dtype, tensor.shape, units.view(np.uint8))
    return out


@pytest.fixture
async def chunk_bus(bus: Bus) -> Bus:
    await provision(bus.js)
    return bus


async def test_chunks_round_trip_through_the_stream_with_parallel_fetches(chunk_bus: Bus) -> None:
    base = random_state(1)
    new = changed(base, 2)
    snapshot, snapshot_chunks = encode_snapshot(base, version=1, options=SMALL)
    delta, delta_chunks = encode(base, new, base_version=1, version=2, options=SMALL)
    assert len(snapshot_chunks) >= 8, "the test needs many chunks"
    publisher = Publisher(chunk_bus.js, max_in_flight=8)
    stored = await store_chunks(publisher, snapshot, snapshot_chunks)
    await store_chunks(publisher, delta, delta_chunks)
    assert stored.num_bytes == sum(ref.num_bytes for ref in snapshot.chunks)

    for parallel, batch in ((1, False), (8, False), (1, True), (4, True)):
        fetched = await fetch_chunks(chunk_bus.nc, snapshot, parallel=parallel, batch=batch)
        rebuilt = decode({}, snapshot, fetched.chunks, kind="raw", verify_full=True)
    fetched_delta = await fetch_chunks(chunk_bus.nc, delta, parallel=4)
    out = decode(rebuilt, delta, fetched_delta.chunks, kind="raw", verify_full=True)
    assert all(np.array_equal(out[n].data, new[n].data) for n in new)


async def test_a_retried_store_is_not_stored_twice(chunk_bus: Bus) -> None:
    manifest, chunks = encode_snapshot(random_state(3), version=5, options=SMALL)
    publisher = Publisher(chunk_bus.js)
    first = await store_chunks(publisher, manifest, chunks)
    again = await store_chunks(publisher, manifest, chunks)
    info = await chunk_bus.js.stream_info(streams.WEIGHT_CHUNKS.name)
    assert info.state.messages == len(chunks)
    assert (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)


async def test_a_tampered_chunk_is_refetched_then_the_version_refused(chunk_bus: Bus) -> None:
    manifest, chunks = encode_snapshot(random_state(4), version=7, options=SMALL)
    await store_chunks(Publisher(chunk_bus.js), manifest, chunks)
    body = bytearray(encode_chunk(chunks[3]))
    body[-10] ^= 0xFF  # one flipped byte inside the compressed payload, same length
    await chunk_bus.js.publish(chunk_subject(manifest, 3), bytes(body))
    refetches_before = CHUNK_REFETCHES.labels("corrupt")._value.get()

    with pytest.raises(CorruptDeltaError, match=r"chunk 3 .* refused after 3 attempts"):
        await fetch_chunks(chunk_bus.nc, manifest, parallel=4, attempts=3)
    assert CHUNK_REFETCHES.labels("corrupt")._value.get() - refetches_before == 2

    # Repaired (the same bytes published again): the version comes through.
    await chunk_bus.js.publish(chunk_subject(manifest, 3), encode_chunk(chunks[3]))
    fetched = await fetch_chunks(chunk_bus.nc, manifest, parallel=4)
    assert [c.header.index for c in fetched.chunks] == list(range(len(chunks)))


async def test_a_purged_chunk_refuses_the_version_at_once(chunk_bus: Bus) -> None:
    manifest, chunks = encode_snapshot(random_state(5), version=9, options=SMALL)
    await store_chunks(Publisher(chunk_bus.js), manifest, chunks)
    await chunk_bus.js.purge_stream(streams.WEIGHT_CHUNKS.name, subject=chunk_subject(manifest, 2))
    with pytest.raises(NotFoundError):
        await chunk_bus.js.get_msg(
            streams.WEIGHT_CHUNKS.name, subject=chunk_subject(manifest, 2), direct=True
        )
    for batch in (True, False):
        with pytest.raises(MissingChunkError, match="not stored"):
            await fetch_chunks(chunk_bus.nc, manifest, parallel=4, batch=batch)


async def test_a_replica_behind_does_not_refuse_a_stored_version(chunk_bus: Bus) -> None:
    """A follower that has not applied the newest chunks yet answers their direct gets with
    404 (a version was refused so on a 3-node cluster under load). Here the only direct-get
    responder is such a replica, injected on the real server (the stream's own direct get is
    off): every chunk still comes, read from the stream's leader."""
    info = await chunk_bus.js.stream_info(streams.WEIGHT_CHUNKS.name)
    await chunk_bus.js.update_stream(config=replace(info.config, allow_direct=False))
    manifest, chunks = encode_snapshot(random_state(8), version=3, options=SMALL)
    await store_chunks(Publisher(chunk_bus.js), manifest, chunks)

    async def behind(msg: Msg) -> None:
        await chunk_bus.nc.publish(msg.reply, b"", headers={"Status": "404"})

    prefix = f"$JS.API.DIRECT.GET.{streams.WEIGHT_CHUNKS.name}"
    replica = [await chunk_bus.nc.subscribe(s, cb=behind) for s in (prefix, f"{prefix}.>")]
    try:
        reads_before = CHUNK_LEADER_READS._value.get()
        for batch in (True, False):
            fetched = await fetch_chunks(chunk_bus.nc, manifest, parallel=4, batch=batch)
            rebuilt = decode({}, manifest, fetched.chunks, kind="raw", verify_full=True)
            assert all(np.array_equal(rebuilt[n].data, t.data) for n, t in random_state(8).items())
        assert CHUNK_LEADER_READS._value.get() - reads_before == 2 * len(chunks)
        # A chunk the leader lacks too is missing: the version is refused at once.
        await chunk_bus.js.purge_stream(
            streams.WEIGHT_CHUNKS.name, subject=chunk_subject(manifest, 1)
        )
        with pytest.raises(MissingChunkError, match="not stored"):
            await fetch_chunks(chunk_bus.nc, manifest, parallel=4)
    finally:
        for sub in replica:
            await sub.unsubscribe()


async def test_a_chunk_above_the_server_limit_is_refused_before_publishing(chunk_bus: Bus) -> None:
    manifest, chunks = encode_snapshot(random_state(6), version=1, options=SMALL)
    with pytest.raises(ValueError, match="max payload"):
        await store_chunks(Publisher(chunk_bus.js), manifest, chunks, max_payload_bytes=4096)
