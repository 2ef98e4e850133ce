"""Reading every message of a stream under a subject filter, once, up to its current end.

For work that looks at stored messages without consuming them (the feedback join's waiting
events, an operator's purge by API key): an ephemeral consumer that acks nothing, read in
batches until the last message delivered says nothing is pending, then removed.

    async for msg in scan_stream(js, "KV_feedback_join", "$KV.feedback_join.wait.>",
                                 last_per_subject=True):
        msg.subject, msg.data, msg.metadata.sequence.stream

`last_per_subject` delivers only the newest message of each subject (a KV bucket's current
values). Messages stored while the scan runs may or may not be delivered.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

SCAN_BATCH = 512
# The server removes a scan's consumer after this long without a fetch (a crashed scanner).
SCAN_INACTIVE_S = 60.0


async def scan_stream(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    last_per_subject: bool = False,
    start_sequence: int = 1,
    batch: int = SCAN_BATCH,
    fetch_timeout_s: float = 2.0,
) -> AsyncIterator[Msg]:
    """Every message of `stream` on `subject` (wildcards allowed) from `start_sequence` on,
    in stream order."""
    if last_per_subject:
        policy, start = js_api.DeliverPolicy.LAST_PER_SUBJECT, None
    elif start_sequence > 1:
        policy, start = js_api.DeliverPolicy.BY_START_SEQUENCE, start_sequence
    else:
        policy, start = js_api.DeliverPolicy.ALL, None
    config = js_api.ConsumerConfig(
        deliver_policy=policy,
        opt_start_seq=start,
        ack_policy=js_api.AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=SCAN_INACTIVE_S,
        mem_storage=True,
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        while pending > 0:
            try:
                msgs = await sub.fetch(min(batch, pending), timeout=fetch_timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                return  # what was pending went meanwhile (a TTL, a purge): the end
            for msg in msgs:
                yield msg
                pending = msg.metadata.num_pending or 0
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
