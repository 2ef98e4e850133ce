"""A connection reads its socket in READ_BUFFER_BYTES, not nats-py's 32 KiB: weight chunks of
several MiB cross in a few reads (libs/bus/connection.py says why and what it measured)."""

from __future__ import annotations

import os

from libs.bus.connection import READ_BUFFER_BYTES, Bus
from libs.bus.provision import ensure_stream
from proto import streams


async def test_a_connection_reads_in_the_wide_buffer_and_carries_a_large_message(
    bus: Bus,
) -> None:
    # nats-py sizes the reader from its module constant at connect: were a release to stop
    # reading it, the reader would be back at 32 KiB and this fails, not the fetch rate.
    reader = bus.nc._transport._io_reader  # type: ignore[union-attr]
    assert reader._limit == READ_BUFFER_BYTES
    await ensure_stream(bus.js, streams.WEIGHT_CHUNKS)
    payload = os.urandom(4 * READ_BUFFER_BYTES + 3)
    await bus.js.publish("rl.weights.chunks.1.delta.0", payload)
    got = await bus.js.get_msg(
        streams.WEIGHT_CHUNKS.name, subject="rl.weights.chunks.1.delta.0", direct=True
    )
    assert got.data == payload
