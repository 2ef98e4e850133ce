"""Create streams, consumers and KV buckets from proto/, idempotently.

A second run changes nothing. A definition that changed in the code is applied when
JetStream can update it in place (limits, subjects, timeouts); a change it cannot apply
(retention, storage, a consumer's filter on a work queue) is refused with a message that
names the field and the way out, because deleting a stream would lose data.

Replication (`replicas`, 1 by default; 3 on a NATS cluster, set by RLPIPE_NATS_REPLICAS) is
applied to every stream and KV bucket: JetStream keeps each message on that many nodes with
Raft, so a node can die with nothing acknowledged lost. Consumers follow their stream's
replication. A running stream can be scaled up or down in place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from libs.bus.connection import NatsOptions, connect_bus
from proto import streams
from proto.streams import ConsumerSpec, KeyValueSpec, StreamSpec

log = structlog.get_logger(__name__)
T = TypeVar("T")

Outcome = Literal["created", "unchanged", "updated"]
# JetStream's limit on one stream's replication.
MAX_REPLICAS = 5

# Fields proto/ defines, compared with what the server holds (others are server defaults).
STREAM_MANAGED_FIELDS = (
    "description",
    "subjects",
    "retention",
    "storage",
    "max_age",
    "max_bytes",
    "max_msgs",
    "max_msg_size",
    "duplicate_window",
    "discard",
    "allow_direct",
    "num_replicas",
)
CONSUMER_MANAGED_FIELDS = (
    "description",
    "deliver_policy",
    "ack_policy",
    "ack_wait",
    "max_deliver",
    "max_ack_pending",
    "filter_subject",
)
# Fields of a KV bucket's stream that proto/ defines and can change in place.
BUCKET_MANAGED_FIELDS = ("num_replicas", "max_bytes", "allow_direct")
# Fields JetStream refuses to change on an existing stream or consumer.
STREAM_FIXED_FIELDS = ("retention", "storage")
CONSUMER_FIXED_FIELDS = ("deliver_policy", "ack_policy", "filter_subject")


class ProvisionError(RuntimeError):
    """The bus holds a definition that differs from proto/ in a way that cannot be updated."""


@dataclass
class ProvisionReport:
    """What provisioning did to each stream, consumer and bucket."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "nothing to do"

    @property
    def changed(self) -> bool:
        return any(o != "unchanged" for o in self.outcomes.values())


def stream_config(spec: StreamSpec, replicas: int = 1) -> js_api.StreamConfig:
    """The nats-py config for a stream spec, kept on `replicas` nodes."""
    return js_api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=js_api.RetentionPolicy(spec.retention),
        storage=js_api.StorageType(spec.storage),
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        max_msg_size=spec.max_msg_bytes,
        duplicate_window=spec.duplicate_window_s,
        discard=js_api.DiscardPolicy(spec.discard),
        allow_direct=spec.allow_direct,
        num_replicas=replicas,
    )


def consumer_config(spec: ConsumerSpec) -> js_api.ConsumerConfig:
    """The nats-py config for a durable pull consumer.

    The server's max_deliver is one above the spec's: our handler dead-letters on its last
    allowed attempt, and the one extra delivery catches a message whose handler never
    returned (a crashed process) so it is dead-lettered too instead of dropped silently.
    """
    return js_api.ConsumerConfig(
        durable_name=spec.durable,
        description=spec.description,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver + 1,
        max_ack_pending=spec.max_ack_pending,
        filter_subject=spec.filter_subject,
    )


def differences(
    wanted: dict[str, Any], existing: dict[str, Any], fields: tuple[str, ...]
) -> dict[str, tuple[Any, Any]]:
    """Managed fields whose wanted value differs: name -> (existing, wanted)."""
    return {
        key: (existing.get(key), wanted.get(key))
        for key in fields
        if _normalize(existing.get(key)) != _normalize(wanted.get(key))
    }


def _normalize(value: Any) -> Any:
    """Compare durations and enums as the server returns them."""
    if hasattr(value, "value"):
        return value.value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return sorted(value)
    return value


def _refuse_fixed(
    kind: str, name: str, diff: dict[str, tuple[Any, Any]], fixed: tuple[str, ...]
) -> None:
    blocked = {k: v for k, v in diff.items() if k in fixed}
    if blocked:
        changes = "; ".join(
            f"{k}: {old!r} on the server, {new!r} in proto/" for k, (old, new) in blocked.items()
        )
        raise ProvisionError(
            f"{kind} {name} cannot be updated in place ({changes}). JetStream cannot change "
            f"these fields; to apply them, drain the {kind}, delete it (data is lost), "
            "and provision again"
        )


def check_replicas(replicas: int) -> None:
    """Refuse a replication JetStream cannot have (1 to 5 nodes)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ProvisionError(
            f"replicas must be 1 to {MAX_REPLICAS} (got {replicas}): set RLPIPE_NATS_REPLICAS "
            "to 1 for one nats-server, 3 for a cluster of 3 or more nodes"
        )


async def _add_stream(js: JetStreamContext, config: js_api.StreamConfig) -> None:
    """Create the stream, again after a short wait when the server failed to make its store."""
    for attempt in range(1, STORE_ATTEMPTS + 1):
        try:
            await _placed(lambda: js.add_stream(config=config), f"stream {config.name}")
            return
        except APIError as exc:
            if exc.err_code != STORE_FAILED_ERR_CODE or attempt == STORE_ATTEMPTS:
                raise
            log.warning("the server could not create the stream's store; trying again",
                        stream=config.name, attempt=attempt, error=str(exc))  # fmt: skip
            await asyncio.sleep(STORE_RETRY_S * attempt)


async def _placed(change: Callable[[], Awaitable[T]], what: str) -> T:
    """`await change()`, again while the cluster refuses placement for want of peers (for up
    to PLACEMENT_WAIT_S): a cluster whose routes are up refuses replicated streams until its
    meta leader has heard from enough peers, and services started beside their NATS nodes
    (compose's cluster profile) provision in exactly those seconds."""
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT_S
    while True:
        try:
            return await change()
        except APIError as exc:
            if exc.err_code != NO_PEERS_ERR_CODE or asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("the cluster has no peers for placement yet; waiting", what=what,
                        error=str(exc))  # fmt: skip
            await asyncio.sleep(PLACEMENT_RETRY_S)


def _refused_replicas(exc: APIError, replicas: int) -> ProvisionError:
    """The server's refusal of a replication, turned into the fix."""
    return ProvisionError(
        f"the server refused {replicas} replicas ({exc}): replicas above 1 need a NATS cluster "
        "with at least that many JetStream nodes; set RLPIPE_NATS_REPLICAS=1 for one "
        "nats-server, or point RLPIPE_NATS_URL at a cluster (deploy/nats/cluster.conf)"
    )


# "error creating store for stream": the server could not make the stream's store folder.
# Seen once in the test suite right after the stream of the same name was deleted (the
# server still removing the old folder, under load); a folder that stays unusable (a file in
# its place, no permission) keeps failing and is raised after the last attempt.
STORE_FAILED_ERR_CODE = 10049
STORE_ATTEMPTS = 4
STORE_RETRY_S = 0.25
# "no suitable peers for placement": the cluster cannot place the replicas now. While a
# cluster forms this passes in seconds; a cluster with fewer nodes than replicas keeps
# refusing and is raised (with the fix) after PLACEMENT_WAIT_S.
NO_PEERS_ERR_CODE = 10005
PLACEMENT_WAIT_S = 30.0
PLACEMENT_RETRY_S = 0.5


async def ensure_stream(js: JetStreamContext, spec: StreamSpec, replicas: int = 1) -> Outcome:
    wanted = stream_config(spec, replicas)
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        try:
            await _add_stream(js, wanted)
        except APIError as exc:
            if replicas > 1:
                raise _refused_replicas(exc, replicas) from exc
            raise
        return "created"
    diff = differences(wanted.as_dict(), info.config.as_dict(), STREAM_MANAGED_FIELDS)
    if not diff:
        return "unchanged"
    _refuse_fixed("stream", spec.name, diff, STREAM_FIXED_FIELDS)
    log.info("updating stream", stream=spec.name, fields=sorted(diff))
    # Sources are not proto/'s to set: a hub's of the regions' outboxes (libs/region/hub.py)
    # stay as they are.
    wanted = replace(wanted, sources=info.config.sources)
    try:
        await _placed(lambda: js.update_stream(config=wanted), f"stream {spec.name}")
    except APIError as exc:
        if "num_replicas" in diff:
            raise _refused_replicas(exc, replicas) from exc
        raise ProvisionError(f"stream {spec.name}: the server refused the update: {exc}") from exc
    return "updated"


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> Outcome:
    wanted = consumer_config(spec)
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:
        await js.add_consumer(spec.stream, config=wanted)
        return "created"
    diff = differences(wanted.as_dict(), info.config.as_dict(), CONSUMER_MANAGED_FIELDS)
    if not diff:
        return "unchanged"
    _refuse_fixed("consumer", f"{spec.stream}/{spec.durable}", diff, CONSUMER_FIXED_FIELDS)
    log.info("updating consumer", consumer=spec.durable, fields=sorted(diff))
    try:
        await js.add_consumer(spec.stream, config=wanted)
    except APIError as exc:
        raise ProvisionError(
            f"consumer {spec.stream}/{spec.durable}: the server refused the update: {exc}"
        ) from exc
    return "updated"


async def ensure_key_value(js: JetStreamContext, spec: KeyValueSpec, replicas: int = 1) -> Outcome:
    try:
        await js.key_value(spec.bucket)
    except BucketNotFoundError:
        config = js_api.KeyValueConfig(
            bucket=spec.bucket,
            description=spec.description,
            history=spec.history,
            max_bytes=spec.max_bytes,
            storage=js_api.StorageType(spec.storage),
            replicas=replicas,
            direct=spec.direct,
        )
        try:
            await _placed(lambda: js.create_key_value(config=config), f"kv {spec.bucket}")
        except APIError as exc:
            if replicas > 1:
                raise _refused_replicas(exc, replicas) from exc
            raise
        return "created"
    return await _update_bucket(js, spec, replicas)


async def _update_bucket(js: JetStreamContext, spec: KeyValueSpec, replicas: int) -> Outcome:
    """A bucket is the stream `KV_<bucket>`: its limit, direct gets and replication are
    changed on that stream, in place."""
    info = await js.stream_info(f"KV_{spec.bucket}")
    updated = replace(
        info.config, num_replicas=replicas, max_bytes=spec.max_bytes, allow_direct=spec.direct
    )
    changed = differences(updated.as_dict(), info.config.as_dict(), BUCKET_MANAGED_FIELDS)
    if not changed:
        return "unchanged"
    log.info("updating kv bucket", bucket=spec.bucket, fields=sorted(changed))
    try:
        await _placed(lambda: js.update_stream(config=updated), f"kv {spec.bucket}")
    except APIError as exc:
        if "num_replicas" in changed:
            raise _refused_replicas(exc, replicas) from exc
        raise ProvisionError(f"kv {spec.bucket}: the server refused the update: {exc}") from exc
    return "updated"


async def provision(
    js: JetStreamContext,
    stream_specs: tuple[StreamSpec, ...] = streams.ALL_STREAMS,
    consumer_specs: tuple[ConsumerSpec, ...] = streams.ALL_CONSUMERS,
    kv_specs: tuple[KeyValueSpec, ...] = streams.ALL_KV,
    *,
    replicas: int = 1,
) -> ProvisionReport:
    """Bring the bus in line with the given definitions (all of proto/ by default), each
    stream and bucket kept on `replicas` nodes."""
    check_replicas(replicas)
    report = ProvisionReport()
    for stream in stream_specs:
        report.outcomes[f"stream {stream.name}"] = await ensure_stream(js, stream, replicas)
    for consumer in consumer_specs:
        key = f"consumer {consumer.stream}/{consumer.durable}"
        report.outcomes[key] = await ensure_consumer(js, consumer)
    for bucket in kv_specs:
        report.outcomes[f"kv {bucket.bucket}"] = await ensure_key_value(js, bucket, replicas)
    log.info("bus provisioned", summary=report.summary())
    return report


async def provision_bus(
    url: str, replicas: int = 1, options: NatsOptions | None = None
) -> ProvisionReport:
    """Connect to `url` (as the admin: `options` or the URL's credentials), provision
    everything in proto/ on `replicas` nodes, disconnect."""
    bus = await connect_bus(url, name="rlpipe-provision", options=options)
    try:
        return await provision(bus.js, replicas=replicas)
    finally:
        await bus.close()
