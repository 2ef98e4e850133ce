"""Reading the weight chain's announcements from the stream: the latest of a kind, the head.

    found = await latest_announcement(js, "snapshot", verifier=verifier)  # (seq, announcement)
    head = await announced_head(js, verifier=verifier)                   # newest version

With a verifier (libs/weights/signing.py), an announcement that is unsigned, forged or
signed by another key counts as none ("none known" until the next real one); without one,
an announcement above the newest version the trainer recorded in the state bucket does.
"""

from __future__ import annotations

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.weights.signing import VersionRefused, VersionVerifier, policy_digest
from proto import streams
from proto.messages import PolicyIdentity, WeightAnnouncement
from proto.subjects import weights_announce_subject
from proto.validation import InvalidValue, check_announcement_plausible

log = structlog.get_logger(__name__)


async def latest_announcement(
    js: JetStreamContext,
    kind: str,
    stream: str = streams.WEIGHTS_ANNOUNCE.name,
    verifier: VersionVerifier | None = None,
) -> tuple[int, WeightAnnouncement] | None:
    """Stream sequence and content of the last `delta` or `snapshot` announcement, if any."""
    try:
        raw = await js.get_msg(stream, subject=weights_announce_subject(kind), direct=True)
    except NotFoundError:
        return None
    if raw.data is None or raw.seq is None:
        return None
    try:
        announcement = wire.decode(WeightAnnouncement, raw.data, raw.headers)
        signed = verifier is not None and verifier.check_announcement(announcement)
        newest = None if signed else await newest_policy_version(js)
        if newest is not None:
            check_announcement_plausible(announcement, newest)
    except (wire.InvalidMessage, InvalidValue, VersionRefused) as exc:
        # A bad last announcement (dead-lettered by the receivers that read it) hides the
        # ones before it until the next real one: "none known" meanwhile.
        log.warning("latest announcement refused", kind=kind, seq=raw.seq, error=str(exc))
        return None
    return raw.seq, announcement


async def latest_snapshot(
    js: JetStreamContext, stream: str, verifier: VersionVerifier | None
) -> tuple[int, WeightAnnouncement] | None:
    """The snapshot announcement to start reading the chain from: without a verifier, the
    last one; with one, the trusted snapshot of the highest version, where it was first
    announced. A copy of an old snapshot published again (it verifies: it is signed) is
    then never where a receiver starts, nor what a purge keeps from. The streams hold one
    or two snapshots after the broadcaster's (or a region's) purge: a few direct gets."""
    if verifier is None:
        return await latest_announcement(js, "snapshot", stream)
    best: tuple[int, WeightAnnouncement] | None = None
    subject, seq = weights_announce_subject("snapshot"), 1
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
        except NotFoundError:
            return best
        if raw.seq is None:
            return best
        seq = raw.seq + 1
        try:
            announcement = wire.decode(WeightAnnouncement, raw.data or b"", raw.headers)
            if not verifier.check_announcement(announcement):  # unsigned, allowed
                newest = await newest_policy_version(js)
                if newest is not None:
                    check_announcement_plausible(announcement, newest)
        except (wire.InvalidMessage, VersionRefused, InvalidValue) as exc:
            log.debug("snapshot announcement skipped", seq=raw.seq, error=str(exc))
            continue
        if best is None or announcement.version > best[1].version:
            best = (raw.seq, announcement)


async def announced_head(
    js: JetStreamContext,
    stream: str = streams.WEIGHTS_ANNOUNCE.name,
    verifier: VersionVerifier | None = None,
) -> WeightAnnouncement | None:
    """The chain's head: the newest announced version (a snapshot where a delta and a
    snapshot share it), or None when nothing is announced."""
    kinds = ("delta", "snapshot")
    entries = [await latest_announcement(js, kind, stream, verifier) for kind in kinds]
    found = [entry[1] for entry in entries if entry is not None]
    if not found:
        return None
    return max(found, key=lambda a: (a.version, a.kind == "snapshot"))


async def newest_policy_version(js: JetStreamContext) -> int | None:
    """The newest version the trainer recorded as made (it writes it before staging any),
    or None where the state bucket or the key is absent (a region's relay server)."""
    try:
        kv = await js.key_value(streams.STATE.bucket)
        entry = await kv.get(streams.POLICY_VERSION_KEY)
        return int((entry.value or b"-1").decode())
    except (NotFoundError, ValueError, nats.errors.Error, TimeoutError) as exc:
        log.debug("newest policy version unknown", error=repr(exc))
        return None


async def read_policy_digest(js: JetStreamContext) -> str:
    """The digest of the PolicyIdentity the trainer stored ("" before one is)."""
    try:
        kv = await js.key_value(streams.STATE.bucket)
        entry = await kv.get(streams.POLICY_IDENTITY_KEY)
        return policy_digest(wire.decode(PolicyIdentity, entry.value or b"", None))
    except (NotFoundError, nats.errors.Error, TimeoutError, wire.InvalidMessage) as exc:
        log.debug("policy identity unknown", error=repr(exc))
        return ""
