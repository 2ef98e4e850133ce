"""What the weight streams keep: the latest snapshot and everything after it.

A late joiner needs the latest snapshot and the deltas after it; anything before the snapshot
version can go. The broadcaster applies the rule on the hub after each snapshot, and the
regional pruner applies it to a region's mirrors (mirrors do not copy the hub's purges).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.weights.announcements import latest_snapshot
from libs.weights.signing import VersionVerifier
from proto import streams
from proto.messages import WeightAnnouncement
from proto.subjects import weight_chunks_filter

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PurgeResult:
    """What a purge kept: everything from the snapshot version on."""

    snapshot_version: int
    chunk_first_seq: int  # first chunk sequence kept
    announce_first_seq: int  # first announcement sequence kept


async def purge_before_latest_snapshot(
    js: JetStreamContext,
    verifier: VersionVerifier | None,
    *,
    announce_stream: str = streams.WEIGHTS_ANNOUNCE.name,
    chunk_stream: str = streams.WEIGHT_CHUNKS.name,
) -> PurgeResult | None:
    """Purge the chunks and announcements of every version before the latest snapshot.

    None when there is nothing to purge by yet (no snapshot, or none of its chunks stored:
    streams hold versions in order, so once the snapshot version's first chunk is there,
    everything before it is too and may go). The snapshot version's delta, announced just
    before its snapshot, is kept, so a worker one version behind still takes the small delta.
    With `verifier`, only a snapshot signed by a trusted key counts (a forged or replayed
    one never makes the real versions go).
    """
    snapshot = await latest_snapshot(js, announce_stream, verifier)
    if snapshot is None:
        return None
    version = snapshot[1].version
    try:
        first = await js.get_msg(
            chunk_stream, seq=1, subject=weight_chunks_filter(version), next=True, direct=True
        )
    except NotFoundError:
        return None
    assert first.seq is not None
    chunk_seq = first.seq
    announce_seq = snapshot[0]
    previous = await _announcement_at(js, announce_stream, announce_seq - 1)
    if previous is not None and previous.version == version:
        announce_seq -= 1
    for stream, seq in ((chunk_stream, chunk_seq), (announce_stream, announce_seq)):
        info = await js.stream_info(stream)
        if info.state.first_seq < seq:
            await js.purge_stream(stream, seq=seq)
            log.info("purged versions before the snapshot", stream=stream, snapshot=version,
                     first_seq=seq)  # fmt: skip
    return PurgeResult(version, chunk_seq, announce_seq)


async def _announcement_at(
    js: JetStreamContext, stream: str, seq: int
) -> WeightAnnouncement | None:
    if seq < 1:
        return None
    try:
        raw = await js.get_msg(stream, seq=seq, direct=True)
    except NotFoundError:
        return None
    if raw.data is None:
        return None
    return wire.decode(WeightAnnouncement, raw.data, raw.headers)
