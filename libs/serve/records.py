"""Served-generation records: every choice the API answers, stored on the generations stream.

Each record is a `ServedGeneration` published to `rl.serving.generations` with
`Nats-Msg-Id` = its generation id, and the API answers only after the stream acknowledged
it, so feedback the product posts for a generation id it has just received can never find
the generation missing.

If the bus cannot store a record (after the publisher's bounded retries), the answer still
goes out: the user asked for a completion, not for a training sample, and failing the
product's request would turn a bus outage into a product outage. The loss is counted
(`rlpipe_serve_generation_records_lost_total`), logged as a warning, and told to the
caller (`X-Generation-Recorded: false`), so a product can skip posting feedback that could
only be dead-lettered as `generation_missing`.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from prometheus_client import Counter

from libs.bus.publisher import Outgoing, Publisher
from proto import subjects
from proto.messages import ServedGeneration

log = structlog.get_logger(__name__)

RECORDED = Counter(
    "rlpipe_serve_generation_records_total", "Served generations stored on the generations stream"
)
LOST = Counter(
    "rlpipe_serve_generation_records_lost_total",
    "Served generations answered but not stored (the bus refused or timed out)",
)


class GenerationRecorder:
    """Publishes served generations; `record` reports whether all of them were stored."""

    def __init__(self, publisher: Publisher, subject: str = subjects.SERVING_GENERATIONS) -> None:
        self.publisher = publisher
        self.subject = subject
        self.num_recorded = 0
        self.num_lost = 0

    async def record(self, generations: Sequence[ServedGeneration]) -> bool:
        """Store `generations` (msg id = generation id); False, counted and logged, if not."""
        outgoing = [Outgoing(self.subject, g, g.generation_id) for g in generations]
        try:
            await self.publisher.publish_many(outgoing)
        except Exception as exc:  # deliberate: a lost record must not fail a served answer
            self.num_lost += len(generations)
            LOST.inc(len(generations))
            log.warning(
                "served generations NOT recorded",
                generation_ids=[g.generation_id for g in generations],
                error=repr(exc),
            )
            return False
        self.num_recorded += len(generations)
        RECORDED.inc(len(generations))
        return True
