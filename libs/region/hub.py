"""The hub's side of a region: its RL_ROLLOUTS_RAW and RL_DEAD_LETTERS source the region's
outboxes (proto/regions.py), across the leaf link, from the region's JetStream domain.

    bus = await connect_bus("nats://admin:...@hub:4222", name="region-hub-setup")
    await source_regions(bus.js, ("region-a",))          # idempotent; as the admin

`rlpipe region hub-setup --regions region-a` runs it. A source copies each message once, in
order, and resumes from where it stopped when the link returns; the hub stream's duplicate
window (message id = rollout id) drops anything stored twice. A region that is not connected
yet, or never was, costs nothing: its sources wait. Provisioning (`rlpipe provision`, a
service's start) keeps the sources it finds; removing a region's is deliberate:
`nats stream edit RL_ROLLOUTS_RAW`.
"""

from __future__ import annotations

from dataclasses import replace

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from libs.bus.provision import ProvisionError, ProvisionReport
from proto.regions import OUTBOXES, api_prefix

log = structlog.get_logger(__name__)


def outbox_source(outbox: str, region: str) -> js_api.StreamSource:
    """The source of a hub stream that copies `region`'s stream `outbox`."""
    return js_api.StreamSource(name=outbox, external=js_api.ExternalStream(api=api_prefix(region)))


def _key(source: js_api.StreamSource) -> tuple[str, str | None]:
    return source.name, source.external.api if source.external is not None else None


async def source_region_outbox(
    js: JetStreamContext, hub_stream: str, outbox: str, regions: tuple[str, ...]
) -> bool:
    """Add to `hub_stream` a source of `outbox` in each of `regions` it lacks; True if any."""
    try:
        info = await js.stream_info(hub_stream)
    except NotFoundError as exc:
        raise ProvisionError(
            f"stream {hub_stream} is not on this server: provision the hub first "
            "(`rlpipe provision`), and point --nats-url at the hub, not a region"
        ) from exc
    held = list(info.config.sources or [])
    wanted = [outbox_source(outbox, region) for region in regions]
    missing = [s for s in wanted if _key(s) not in {_key(h) for h in held}]
    if not missing:
        return False
    log.info("sourcing regional outboxes", stream=hub_stream, regions=list(regions))
    try:
        await js.update_stream(config=replace(info.config, sources=held + missing))
    except APIError as exc:
        raise ProvisionError(f"stream {hub_stream}: the server refused the sources: {exc}") from exc
    return True


async def source_regions(js: JetStreamContext, regions: tuple[str, ...]) -> ProvisionReport:
    """Make every hub stream of proto.regions.OUTBOXES source each region's outbox."""
    for region in regions:
        api_prefix(region)  # a bad name is refused before anything changes
    report = ProvisionReport()
    for hub_stream, outbox in OUTBOXES.items():
        changed = await source_region_outbox(js, hub_stream, outbox.name, regions)
        report.outcomes[f"sources of {hub_stream}"] = "updated" if changed else "unchanged"
    return report
