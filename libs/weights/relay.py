"""Weights relayed to another region: mirrors of the weight streams in the region's domain.

A region runs its own nats-server with its own JetStream domain, connected to the training
cluster's server (the hub) as a leaf node (deploy/nats/region-leaf.conf). In the region, the
chunk stream and the announce stream are mirrors of the hub's, under the same names:

    bus = await connect_bus("nats://region-nats:4222", name="relay-setup")
    await setup_relay(bus.js, hub_domain="hub")           # idempotent
    await prune_region(bus.js, verifier)                  # repeat the hub's purge, locally

A worker connected to the regional server reads the mirrors with the ordinary receiver
code: its direct gets (`$JS.API.DIRECT.GET.<stream>`) and its announce consumer are served
by the mirrors, because the server keeps `$JS.API.>` off a leaf node link between two
domains. Each chunk crosses the link once, however many workers the region has.

One thing differs from the hub: the two mirrors copy independently, so an announcement (a
few KB) can arrive before its chunks (a snapshot may be GBs behind it on a slow link). On the
hub a chunk missing from an announced version means it is gone; on a mirror it is usually on
its way. `RegionalWeightReceiver` is the receiver that waits for the chunks of a version it
takes (bounded, `chunk_wait_s`) before fetching; workers in a region use it.

What mirrors do not do: replicate the hub's purges. The hub deletes everything before its
latest snapshot; a mirror keeps it. `prune_region` applies the same rule to the regional
copies (everything before the latest snapshot the region holds), and `rlpipe weights
relay-prune --every-s S` runs it in a loop. A byte or age limit on the mirrors is possible
(`MirrorLimits`) but is a cap, not a policy: set below one snapshot plus its deltas, it
evicts the snapshot a late joiner needs. docs/weights-relay.md has the whole story.

Mirrors copy whatever the hub's streams hold, forged announcements included: what is trusted
is decided by a signature (libs/weights/signing.py), checked by every regional receiver
before it takes a version (and dead-lettered there, as on the hub) and by `prune_region`,
which purges only by a snapshot signed with a trusted key.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from libs.bus.provision import Outcome, ProvisionError, ProvisionReport, differences
from libs.weights.format import Manifest
from libs.weights.receiver import WeightReceiver
from libs.weights.retention import PurgeResult, purge_before_latest_snapshot
from libs.weights.signing import VersionVerifier
from libs.weights.transport import manifest_kind
from proto import streams
from proto.messages import WeightAnnouncement
from proto.streams import StreamSpec
from proto.subjects import weight_chunks_filter

log = structlog.get_logger(__name__)

RELAYED_STREAMS: tuple[StreamSpec, ...] = (streams.WEIGHTS_ANNOUNCE, streams.WEIGHT_CHUNKS)
MIRROR_MANAGED_FIELDS = (
    "description",
    "storage",
    "max_age",
    "max_bytes",
    "max_msg_size",
    "discard",
    "allow_direct",
)
_DOMAIN = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class MirrorLimits:
    """Limits of a regional mirror; the defaults keep everything until `prune_region`."""

    max_bytes: int = -1  # -1: no limit; a cap below snapshot + deltas breaks late joiners
    max_age_s: float = 0.0  # 0: no limit (a long pause in training must not expire a snapshot)


PruneResult = PurgeResult  # what `prune_region` kept


def hub_api_prefix(hub_domain: str) -> str:
    """The JetStream API prefix of the hub's domain, as seen from a leaf node."""
    if not _DOMAIN.match(hub_domain):
        raise ValueError(
            f"hub domain {hub_domain!r}: use the hub server's `jetstream.domain` (letters, "
            "digits, '-' and '_')"
        )
    return f"$JS.{hub_domain}.API"


def mirror_config(
    spec: StreamSpec, hub_domain: str, limits: MirrorLimits = MirrorLimits()
) -> js_api.StreamConfig:
    """A mirror of the hub's stream `spec`, under the same name, answering direct gets."""
    return js_api.StreamConfig(
        name=spec.name,
        description=f"Mirror of {spec.name} in domain {hub_domain}. {spec.description}",
        storage=js_api.StorageType(spec.storage),
        max_age=limits.max_age_s,
        max_bytes=limits.max_bytes,
        max_msg_size=spec.max_msg_bytes,
        discard=js_api.DiscardPolicy.OLD,
        # Direct gets on the mirror's own name: what the receiver sends. (`mirror_direct`
        # would make it answer for the origin too; the origin is in another domain.)
        allow_direct=True,
        mirror=js_api.StreamSource(
            name=spec.name, external=js_api.ExternalStream(api=hub_api_prefix(hub_domain))
        ),
    )


async def ensure_mirror(
    js: JetStreamContext, spec: StreamSpec, hub_domain: str, limits: MirrorLimits = MirrorLimits()
) -> Outcome:
    """Create the regional mirror of `spec`, or bring its limits in line; idempotent."""
    wanted = mirror_config(spec, hub_domain, limits)
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        await js.add_stream(config=wanted)
        return "created"
    _check_origin(spec.name, info.config, wanted)
    diff = differences(wanted.as_dict(), info.config.as_dict(), MIRROR_MANAGED_FIELDS)
    if not diff:
        return "unchanged"
    log.info("updating mirror", stream=spec.name, fields=sorted(diff))
    try:
        await js.update_stream(config=wanted)
    except APIError as exc:
        raise ProvisionError(f"mirror {spec.name}: the server refused the update: {exc}") from exc
    return "updated"


def _check_origin(name: str, existing: js_api.StreamConfig, wanted: js_api.StreamConfig) -> None:
    """Refuse a stream that is not a mirror of the same origin (JetStream cannot change it)."""
    assert wanted.mirror is not None and wanted.mirror.external is not None
    mirror = existing.mirror
    api = mirror.external.api if mirror is not None and mirror.external is not None else None
    origin = (wanted.mirror.name, wanted.mirror.external.api)
    if mirror is not None and (mirror.name, api) == origin:
        return
    held = "a plain stream" if mirror is None else f"a mirror of {mirror.name} via {api}"
    raise ProvisionError(
        f"stream {name} in this domain is {held}, not a mirror of {wanted.mirror.name} via "
        f"{wanted.mirror.external.api}. A service that provisions the bus (`rlpipe provision`) "
        "was probably pointed at the regional server. JetStream cannot turn it into a mirror: "
        f"delete it (`nats stream rm {name}`; its data is a copy) and run relay-setup again"
    )


async def setup_relay(
    js: JetStreamContext,
    hub_domain: str,
    *,
    limits: MirrorLimits = MirrorLimits(),
    stream_specs: tuple[StreamSpec, ...] = RELAYED_STREAMS,
) -> ProvisionReport:
    """Mirror the hub's weight streams into the domain `js` talks to (the region's)."""
    report = ProvisionReport()
    for spec in stream_specs:
        report.outcomes[f"mirror {spec.name}"] = await ensure_mirror(js, spec, hub_domain, limits)
    log.info("weights relay set up", hub_domain=hub_domain, summary=report.summary())
    return report


async def prune_region(
    js: JetStreamContext,
    verifier: VersionVerifier,
    *,
    announce_stream: str = streams.WEIGHTS_ANNOUNCE.name,
    chunk_stream: str = streams.WEIGHT_CHUNKS.name,
) -> PruneResult | None:
    """Purge the regional mirrors of every version before the latest snapshot they hold: the
    hub's rule (libs.weights.retention), applied to the copies. None when there is nothing
    to prune yet (no snapshot, or its chunks have not arrived). Only a snapshot `verifier`
    trusts counts."""
    return await purge_before_latest_snapshot(
        js, verifier, announce_stream=announce_stream, chunk_stream=chunk_stream
    )


async def chunks_arrived(js: JetStreamContext, manifest: Manifest, stream: str) -> bool:
    """Whether `stream` holds every chunk subject of `manifest` (False: stream absent)."""
    wanted = len(manifest.chunks)
    if wanted == 0:
        return True
    subjects = weight_chunks_filter(manifest.version, manifest_kind(manifest))
    try:
        info = await js.stream_info(stream, subjects_filter=subjects)
    except NotFoundError:
        return False
    return len(info.state.subjects or {}) >= wanted


async def wait_for_chunks(
    js: JetStreamContext,
    manifest: Manifest,
    *,
    stream: str = streams.WEIGHT_CHUNKS.name,
    timeout_s: float = 600.0,
    poll_s: float = 0.1,
) -> bool:
    """Wait until a mirror holds every chunk of `manifest`; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while not await chunks_arrived(js, manifest, stream):
        if time.monotonic() >= deadline:
            log.warning("chunks did not arrive in the region", version=manifest.version)
            return False
        waited = True
        await asyncio.sleep(poll_s)
    if waited:
        log.info("chunks arrived in the region", version=manifest.version)
    return True


class RegionalWeightReceiver(WeightReceiver):
    """A WeightReceiver for a regional server: before fetching a version it takes, it waits
    (up to `config.chunk_wait_s`) for the chunk mirror to hold all of that version's chunks.
    After the wait it fetches as usual; a chunk still missing then is refused as on the hub."""

    async def _wanted(self, announcement: WeightAnnouncement) -> bool:
        if not await super()._wanted(announcement):
            return False
        await wait_for_chunks(
            self._bus.js, announcement.manifest, stream=self._chunk_stream,
            timeout_s=self.config.chunk_wait_s,
        )  # fmt: skip
        return True


async def mirror_status(
    js: JetStreamContext, stream_specs: tuple[StreamSpec, ...] = RELAYED_STREAMS
) -> dict[str, dict[str, Any]]:
    """Per mirror: messages and bytes held, last sequence, lag behind the hub (messages) and
    milliseconds since the link last delivered (None: not active)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in stream_specs:
        info = await js.stream_info(spec.name)
        source = info.mirror
        active_ns = source.active if source is not None else None
        out[spec.name] = {
            "messages": info.state.messages,
            "bytes": info.state.bytes,
            "last_seq": info.state.last_seq,
            "lag": source.lag if source is not None else None,
            "active_ms": None if active_ns is None or active_ns < 0 else active_ns / 1e6,
        }
    return out
