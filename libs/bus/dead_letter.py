"""Dead letters: a message no handler could process, stored with why and where it came from.

The body is a `DeadLetter` (with the original payload and headers); the reason, origin and
error also travel in headers so operators can filter without decoding. The msg id is
derived from the origin stream and sequence, so dead-lettering twice stores it once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from libs.bus import wire
from libs.bus.publisher import Publisher
from proto.messages import DeadLetter
from proto.subjects import dead_letter_subject


@dataclass(frozen=True)
class Delivery:
    """Where a message came from and how often it was delivered."""

    subject: str
    stream: str
    stream_sequence: int
    num_delivered: int
    headers: dict[str, str]
    num_pending: int = 0
    """Messages left for the consumer after this one when it was delivered (0 if unknown)."""

    @property
    def msg_id(self) -> str | None:
        return self.headers.get(wire.MSG_ID_HEADER)


async def publish_dead_letter(
    publisher: Publisher,
    payload: bytes,
    delivery: Delivery,
    consumer: str,
    reason: str,
    error: str,
) -> None:
    """Store a dead letter for `payload`; raises if it could not be stored."""
    letter = DeadLetter(
        origin_subject=delivery.subject,
        origin_stream=delivery.stream,
        consumer=consumer,
        reason=reason,  # type: ignore[arg-type]  # callers pass one of DeadLetter's reasons
        error=error[:2000],
        num_delivered=delivery.num_delivered,
        stream_sequence=delivery.stream_sequence,
        payload=payload,
        headers=delivery.headers,
        failed_at=time.time(),
    )
    headers = wire.headers_for(letter, f"dead:{delivery.stream}:{delivery.stream_sequence}")
    headers[wire.DEAD_REASON_HEADER] = reason
    headers[wire.DEAD_ORIGIN_HEADER] = f"{delivery.stream}/{consumer}"
    headers[wire.DEAD_ERROR_HEADER] = error.replace("\r", " ").replace("\n", " ")[:500]
    await publisher.publish_raw(dead_letter_subject(delivery.stream), wire.encode(letter), headers)
