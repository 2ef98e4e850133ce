"""A region's server made self-sufficient: mirrors of what it needs from the hub, its own work
queue and its outboxes (proto/regions.py). Run on the regional server, as its relay user:

    bus = await connect_bus("nats://relay:...@region-nats:4222", name="region-setup")
    report = await setup_region(bus.js, hub_domain="hub")   # idempotent
    status = await region_status(bus.js)                      # what it holds, how far behind

`rlpipe region setup --hub-domain hub` and `rlpipe region status` run these. The weight
mirrors are libs/weights/relay.py's; the trainer's state is mirrored here as a KV bucket of
the same name (one value per key, so a key the trainer wrote once, its policy identity, is
never evicted by the ones it writes often). The work queue and the outboxes are provisioned
from their specs, as the hub's streams are.
"""

from __future__ import annotations

from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from libs.bus.provision import (
    Outcome,
    ProvisionError,
    ProvisionReport,
    differences,
    provision,
)
from libs.weights.relay import setup_relay
from proto.regions import (
    MIRRORED_BUCKETS,
    MIRRORED_STREAMS,
    REGION_CONSUMERS,
    REGION_STREAMS,
    api_prefix,
    bucket_stream,
)
from proto.streams import KeyValueSpec

log = structlog.get_logger(__name__)

BUCKET_MIRROR_FIELDS = ("description", "max_msgs_per_subject", "max_bytes", "allow_direct")


def bucket_mirror_config(spec: KeyValueSpec, hub_domain: str) -> js_api.StreamConfig:
    """A mirror of the hub's KV bucket `spec` under the same name, read as a bucket."""
    name = bucket_stream(spec)
    return js_api.StreamConfig(
        name=name,
        description=f"Mirror of {name} in domain {hub_domain}. {spec.description}",
        storage=js_api.StorageType(spec.storage),
        # A bucket keeps one value per key (history 1): so does its copy.
        max_msgs_per_subject=spec.history,
        max_bytes=spec.max_bytes,
        discard=js_api.DiscardPolicy.NEW,
        allow_direct=spec.direct,
        mirror=js_api.StreamSource(
            name=name, external=js_api.ExternalStream(api=api_prefix(hub_domain))
        ),
    )


async def ensure_bucket_mirror(
    js: JetStreamContext, spec: KeyValueSpec, hub_domain: str
) -> Outcome:
    """Create the regional mirror of the bucket, or bring its limits in line; idempotent."""
    wanted = bucket_mirror_config(spec, hub_domain)
    assert wanted.name is not None
    try:
        info = await js.stream_info(wanted.name)
    except NotFoundError:
        await js.add_stream(config=wanted)
        return "created"
    mirror = info.config.mirror
    if mirror is None or mirror.name != wanted.name:
        raise ProvisionError(
            f"stream {wanted.name} in this domain is not a mirror of the hub's bucket: a "
            "service that provisions was probably pointed at the regional server. Delete it "
            f"(`nats stream rm {wanted.name}`; its data is a copy) and run region setup again"
        )
    diff = differences(wanted.as_dict(), info.config.as_dict(), BUCKET_MIRROR_FIELDS)
    if not diff:
        return "unchanged"
    try:
        await js.update_stream(config=wanted)
    except APIError as exc:
        raise ProvisionError(f"mirror {wanted.name}: the server refused the update: {exc}") from exc
    return "updated"


async def setup_region(js: JetStreamContext, hub_domain: str) -> ProvisionReport:
    """Everything a region's server holds, in the domain `js` talks to (the region's). The
    weight mirrors keep everything until relay-prune (libs/weights/relay.py)."""
    api_prefix(hub_domain)  # a bad name is refused before anything changes
    report = await setup_relay(js, hub_domain, stream_specs=MIRRORED_STREAMS)
    for spec in MIRRORED_BUCKETS:
        outcome = await ensure_bucket_mirror(js, spec, hub_domain)
        report.outcomes[f"mirror {bucket_stream(spec)}"] = outcome
    own = await provision(js, REGION_STREAMS, REGION_CONSUMERS, ())
    report.outcomes |= own.outcomes
    log.info("region set up", hub_domain=hub_domain, summary=report.summary())
    return report


async def region_status(js: JetStreamContext) -> dict[str, dict[str, Any]]:
    """Per stream of the region: messages held, and for a mirror its lag behind the hub and
    milliseconds since the link last delivered (None: not active); for the work queue the
    tasks waiting and in progress."""
    names = [s.name for s in (*MIRRORED_STREAMS, *REGION_STREAMS)]
    names += [bucket_stream(b) for b in MIRRORED_BUCKETS]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        info = await js.stream_info(name)
        entry: dict[str, Any] = {"messages": info.state.messages, "last_seq": info.state.last_seq}
        if info.mirror is not None:
            active_ns = info.mirror.active
            entry["lag"] = info.mirror.lag
            entry["active_ms"] = None if active_ns is None or active_ns < 0 else active_ns / 1e6
        out[name] = entry
    for consumer in REGION_CONSUMERS:
        c = await js.consumer_info(consumer.stream, consumer.durable)
        out[consumer.stream] |= {"pending": c.num_pending, "in_progress": c.num_ack_pending}
    return out
