"""Who may do what on the bus: one NATS identity per role, least privilege, from proto/.

Each role lists the subjects it publishes and subscribes to, drawn from `proto.subjects` and
`proto.streams`: its own subjects, the JetStream API calls on its own streams and consumers
(`$JS.API.CONSUMER.*`, `$JS.API.STREAM.INFO`, direct gets), `$JS.ACK.<stream>.<consumer>.>`
for the acks of its durable consumers, `$KV.<bucket>.<key>` for the keys it writes, and its
own reply inbox (`_INBOX_<role>.>`: a client connects with that inbox prefix, so it cannot
read other clients' replies). Creating, changing or deleting streams, consumers and buckets
is the admin's alone (provisioning, `rlpipe provision`).

`rlpipe nats-config render` writes deploy/nats/auth.conf from this module (`--check` fails
when the shipped file is stale), and tests/test_bus_permissions.py checks every role against
a real nats-server: each does its own job and is refused everything else.

    role = ROLES["reward"]
    role.publish      # ("rl.rollouts.scored", "rl.dead.rl_rollouts_raw", "$JS.API...", ...)

Depends on nothing heavy (any process may import proto).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import same_host, streams, subjects
from proto.fleet import REPLICA_STATUS_PREFIX
from proto.regions import (
    HUB_DOMAIN,
    HUB_TASKS,
    MIRRORED_BUCKETS,
    MIRRORED_STREAMS,
    OUTBOXES,
    REGION_CONSUMERS,
    REGION_STREAMS,
    REGION_WORKER_TASKS,
    REGIONS,
    api_prefix,
    bucket_stream,
)
from proto.streams import ConsumerSpec, KeyValueSpec, StreamSpec

API = "$JS.API"
INBOX_PREFIX = "_INBOX"


@dataclass(frozen=True)
class Role:
    """One bus identity: a NATS user named `name` with these permissions."""

    name: str
    description: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer requests it received (env-gateway's replies), whatever their reply subject.
    allow_responses: bool = False

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)

    @property
    def password_variable(self) -> str:
        """The hub server's environment variable that holds this user's password."""
        return password_variable(self.name)


def password_variable(name: str, server: str = "") -> str:
    """`RLPIPE_NATS_<NAME>_PASSWORD`; a regional server's users: `RLPIPE_NATS_REGION_...`."""
    server_part = f"{server.upper()}_" if server else ""
    return f"RLPIPE_NATS_{server_part}{name.upper().replace('-', '_')}_PASSWORD"


def inbox_prefix(role: str) -> str:
    """The reply-inbox prefix of `role`'s connections: `_INBOX_reward`, `_INBOX_feedback_api`."""
    return f"{INBOX_PREFIX}_{role.replace('-', '_')}"


# --- JetStream API building blocks ----------------------------------------------------------


def stream_info(stream: StreamSpec | str) -> tuple[str, ...]:
    return (f"{API}.STREAM.INFO.{_name(stream)}",)


def direct_reads(stream: StreamSpec | str) -> tuple[str, ...]:
    """Reading single messages: direct gets (by subject, batched) and the leader's get."""
    name = _name(stream)
    return (
        *stream_info(name),
        f"{API}.DIRECT.GET.{name}",
        f"{API}.DIRECT.GET.{name}.>",
        f"{API}.STREAM.MSG.GET.{name}",
    )


def ephemeral_reader(stream: StreamSpec | str) -> tuple[str, ...]:
    """Reading a stream through consumers of its own (unacked, removed when idle): create,
    fetch, look up and remove them. It can create consumers on this stream only."""
    name = _name(stream)
    return (
        *direct_reads(name),
        f"{API}.CONSUMER.CREATE.{name}",
        f"{API}.CONSUMER.CREATE.{name}.>",
        f"{API}.CONSUMER.INFO.{name}.>",
        f"{API}.CONSUMER.MSG.NEXT.{name}.>",
        f"{API}.CONSUMER.DELETE.{name}.>",
        f"$JS.FC.{name}.>",
        f"$JS.FC.*.*.{name}.>",
    )


def durable_consumer(spec: ConsumerSpec) -> tuple[str, ...]:
    """Pulling from and acking a durable consumer provisioning made; dead-lettering what fails.
    Acks take either form the server may name: `$JS.ACK.<stream>...` and, in a JetStream
    domain, `$JS.ACK.<domain>.<account hash>.<stream>...`."""
    return (
        *stream_info(spec.stream),
        f"{API}.CONSUMER.INFO.{spec.stream}.{spec.durable}",
        f"{API}.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}",
        f"$JS.ACK.{spec.stream}.{spec.durable}.>",
        f"$JS.ACK.*.*.{spec.stream}.{spec.durable}.>",
        subjects.dead_letter_subject(spec.stream),
    )


def consumer_lookup(spec: ConsumerSpec) -> tuple[str, ...]:
    """Reading a consumer's state (its backlog) without consuming."""
    return (f"{API}.CONSUMER.INFO.{spec.stream}.{spec.durable}",)


def kv_reads(spec: KeyValueSpec) -> tuple[str, ...]:
    """Binding a bucket and reading (or watching) any of its keys."""
    return ephemeral_reader(f"KV_{spec.bucket}")


def kv_writes(spec: KeyValueSpec, *keys: str) -> tuple[str, ...]:
    """Putting, updating and deleting `keys` (NATS wildcards allowed) of a bucket."""
    return tuple(f"$KV.{spec.bucket}.{key}" for key in keys)


def _name(stream: StreamSpec | str) -> str:
    return stream if isinstance(stream, str) else stream.name


def _role(
    name: str,
    description: str,
    publish: tuple[str, ...],
    subscribe: tuple[str, ...] = (),
    *,
    allow_responses: bool = False,
) -> Role:
    """A role whose subscriptions include its own reply inbox (every request's answer, every
    JetStream API reply and pulled message arrives there)."""
    unique = tuple(dict.fromkeys(publish))
    inbox = f"{inbox_prefix(name)}.>"
    return Role(name, description, unique, (*subscribe, inbox), allow_responses)


# --- the roles ------------------------------------------------------------------------------

WEIGHT_READS = (
    *ephemeral_reader(streams.WEIGHTS_ANNOUNCE),
    *direct_reads(streams.WEIGHT_CHUNKS),
    # A forged or broken announcement is dead-lettered by the receiver that read it.
    subjects.dead_letter_subject(streams.WEIGHTS_ANNOUNCE.name),
)
STATE_READS = kv_reads(streams.STATE)
TRAINER_KEYS = (
    streams.POLICY_VERSION_KEY,
    streams.GROUPS_TAKEN_KEY,
    streams.BATCH_GROUPS_KEY,
    streams.MAX_STALENESS_KEY,
    streams.PROMOTED_VERSION_KEY,
    streams.POLICY_IDENTITY_KEY,
    same_host.same_host_shelf_key("*"),
    same_host.same_host_version_key("*"),
)

ADMIN = Role(
    "admin",
    "Provisioning and operators: creates, changes and deletes streams, consumers and buckets "
    "(`rlpipe provision`, the demo launcher); everything else too. Never a service's.",
    publish=(">",),
    subscribe=(">",),
)
TRAINER = _role(
    "trainer",
    "Reads scored rollouts and online samples from its own position; stages weight versions "
    "for the broadcaster; writes its progress, policy identity and promotions; its eval "
    "gate plays episodes against the env-gateway (request/reply).",
    publish=(
        subjects.ENV_ALL,
        *ephemeral_reader(streams.ROLLOUTS_SCORED),
        *ephemeral_reader(streams.ROLLOUTS_ONLINE),
        subjects.dead_letter_subject(streams.ROLLOUTS_SCORED.name),
        subjects.dead_letter_subject(streams.ROLLOUTS_ONLINE.name),
        subjects.WEIGHTS_STAGED,
        *stream_info(streams.WEIGHTS_STAGED),
        subjects.PROMOTIONS,
        *direct_reads(streams.PROMOTIONS),
        *direct_reads(streams.WEIGHTS_ANNOUNCE),
        same_host.same_host_subject("*"),
        *STATE_READS,
        *kv_writes(streams.STATE, *TRAINER_KEYS),
    ),
)
WEIGHT_BROADCASTER = _role(
    "weight-broadcaster",
    "Takes staged versions; stores their chunks and announces them; purges what no one needs "
    "(everything before the latest snapshot) from its two streams.",
    publish=(
        *durable_consumer(streams.WEIGHT_BROADCASTER_STAGED),
        subjects.WEIGHTS_ANNOUNCE_DELTA,
        subjects.WEIGHTS_ANNOUNCE_SNAPSHOT,
        subjects.WEIGHT_CHUNKS_ALL,
        *direct_reads(streams.WEIGHTS_ANNOUNCE),
        *direct_reads(streams.WEIGHT_CHUNKS),
        f"{API}.STREAM.PURGE.{streams.WEIGHTS_ANNOUNCE.name}",
        f"{API}.STREAM.PURGE.{streams.WEIGHT_CHUNKS.name}",
        *STATE_READS,
    ),
)
ROLLOUT_WORKER = _role(
    "rollout-worker",
    "Pulls tasks, runs episodes against the env-gateway (request/reply), publishes raw "
    "rollouts; reads weights and the trainer's state, never writes them.",
    publish=(
        *durable_consumer(streams.ROLLOUT_WORKER_TASKS),
        subjects.ROLLOUTS_RAW_ALL,
        subjects.ENV_ALL,
        *WEIGHT_READS,
        *STATE_READS,
    ),
    subscribe=(same_host.same_host_subject("*"),),
)
SERVE_REPLICA = _role(
    "serve-replica",
    "A rollout-worker in serve mode facing users: follows weights and the promoted version, "
    "records what it served; pulls no tasks, publishes no rollouts.",
    publish=(subjects.SERVING_GENERATIONS, *WEIGHT_READS, *STATE_READS),
)
# The serving fleet (proto/fleet.py): a lendable replica's status key, and the bucket's binding.
FLEET_STATUS_WRITES = (
    *stream_info(f"KV_{streams.FLEET.bucket}"),
    *kv_writes(streams.FLEET, f"{REPLICA_STATUS_PREFIX}*"),
)
LENDABLE_REPLICA = _role(
    "lendable-replica",
    "A serve replica the capacity controller may lend to RL: what serve-replica may, and while "
    "lent what a rollout-worker may (tasks, raw rollouts, env requests); takes its fleet "
    "commands, answers them, puts its status. No decision, no other replica's command.",
    publish=(
        subjects.SERVING_GENERATIONS,
        *durable_consumer(streams.ROLLOUT_WORKER_TASKS),
        subjects.ROLLOUTS_RAW_ALL,
        subjects.ENV_ALL,
        *WEIGHT_READS,
        *STATE_READS,
        *FLEET_STATUS_WRITES,
    ),
    subscribe=(subjects.FLEET_COMMANDS_ALL,),
    allow_responses=True,  # its answer to the controller's command
)
CAPACITY_CONTROLLER = _role(
    "capacity-controller",
    "Reads the serve replicas' statuses, sends them lend and recall commands, records each "
    "decision; nothing else (no tasks, weights or state).",
    publish=(
        subjects.FLEET_COMMANDS_ALL,
        subjects.FLEET_DECISIONS,
        *kv_reads(streams.FLEET),
    ),
)
ENV_GATEWAY = _role(
    "env-gateway",
    "Answers env requests (runs model-written code in its sandbox); its feeder publishes "
    "tasks, reads the task backlog and the trainer's state, keeps its own position.",
    publish=(
        subjects.TASKS_ALL,
        *consumer_lookup(streams.ROLLOUT_WORKER_TASKS),
        *stream_info(streams.TASKS),
        *STATE_READS,
        *kv_writes(streams.STATE, f"{streams.TASK_FEEDER_KEY_PREFIX}*"),
    ),
    # The feeder hears the trainer's progress as it is written: a KV put is a publish on
    # `$KV.<bucket>.<key>` (libs/envs/feeder.py).
    subscribe=(
        subjects.ENV_ALL,
        *kv_writes(
            streams.STATE,
            streams.POLICY_VERSION_KEY,
            streams.GROUPS_TAKEN_KEY,
            streams.MAX_STALENESS_KEY,
            streams.BATCH_GROUPS_KEY,
        ),
    ),
    allow_responses=True,
)
REWARD = _role(
    "reward",
    "Scores raw rollouts and publishes the scored ones.",
    publish=(*durable_consumer(streams.REWARD_ROLLOUTS), subjects.ROLLOUTS_SCORED),
)
# The feedback API's shared rate limit: reading and compare-and-swapping its keys' buckets.
FEEDBACK_RATE_STATE = (
    *direct_reads(f"KV_{streams.FEEDBACK_RATE.bucket}"),
    *kv_writes(streams.FEEDBACK_RATE, ">"),
)
FEEDBACK_INGESTER = _role(
    "feedback-ingester",
    "The feedback join: reads served generations and feedback events, keeps its join state "
    "(removing a generation's waiting events at once by a purge of their keys), publishes "
    "online samples; with role=all also the API's rate limit.",
    publish=(
        *durable_consumer(streams.JOINER_GENERATIONS),
        *durable_consumer(streams.JOINER_FEEDBACK),
        *direct_reads(streams.SERVING_GENERATIONS),
        subjects.ROLLOUTS_ONLINE,
        *kv_reads(streams.FEEDBACK_JOIN),
        *kv_writes(streams.FEEDBACK_JOIN, ">"),
        f"{API}.STREAM.PURGE.KV_{streams.FEEDBACK_JOIN.bucket}",
        *FEEDBACK_RATE_STATE,
    ),
)
FEEDBACK_API = _role(
    "feedback-api",
    "The product-facing HTTP API: stores feedback events and keeps its keys' rate-limit "
    "buckets, nothing else (no other JetStream API).",
    publish=(subjects.FEEDBACK_EVENTS, *FEEDBACK_RATE_STATE),
)

_CLIENT_ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        ADMIN,
        TRAINER,
        WEIGHT_BROADCASTER,
        ROLLOUT_WORKER,
        SERVE_REPLICA,
        LENDABLE_REPLICA,
        CAPACITY_CONTROLLER,
        ENV_GATEWAY,
        REWARD,
        FEEDBACK_INGESTER,
        FEEDBACK_API,
    )
}
# --- regions ----------------------------------------------------------------------------------
# A region runs its own nats-server, a leaf node of the hub (deploy/nats/region-leaf.conf), in
# a JetStream domain of its own, and its services connect to it alone: proto/regions.py says
# what crosses the link (mirrors of the weights and the trainer's state in, tasks pulled from
# the hub's queue in, the outboxes of rollouts and dead letters sourced out by the hub).

MIRRORED = (*(s.name for s in MIRRORED_STREAMS), *(bucket_stream(b) for b in MIRRORED_BUCKETS))
RELAYED_STREAMS = MIRRORED_STREAMS
RELAYED_NAMES = tuple(spec.name for spec in MIRRORED_STREAMS)
REGION_NAMES = tuple(spec.name for spec in REGION_STREAMS)
OUTBOX_NAMES = tuple(spec.name for spec in OUTBOXES.values())
# The region's env-gateway pulls from the hub's shared task consumer across the link.
HUB_TASK_PULLS = (
    f"{api_prefix(HUB_DOMAIN)}.CONSUMER.MSG.NEXT.{HUB_TASKS.stream}.{HUB_TASKS.durable}",
    f"$JS.ACK.{HUB_TASKS.stream}.{HUB_TASKS.durable}.>",
    f"$JS.ACK.*.*.{HUB_TASKS.stream}.{HUB_TASKS.durable}.>",
)


def _source_consumers(api: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """What a server sends to make and keep the mirror or source consumers of streams `names`
    in the domain of `api`: create, delete, look up, and its flow-control replies."""
    return tuple(
        subject
        for name in names
        for subject in (
            f"{api}.CONSUMER.CREATE.{name}",
            f"{api}.CONSUMER.CREATE.{name}.>",
            f"{api}.CONSUMER.DELETE.{name}.>",
            f"{api}.STREAM.INFO.{name}",
            f"$JS.FC.{name}.>",
            f"$JS.FC.*.*.{name}.>",
        )
    )


def leaf_role(region: str) -> Role:
    """The identity `region`'s server links to the hub with (its leaf connection). From the
    hub's side, what a leaf may publish is exported to the hub and what it may subscribe to
    is imported into the region. Out: making the region's mirror consumers on the hub (the
    weight streams, the trainer's state), the region's env-gateway's pulls and acks on the
    hub's task consumer, and the region's answers to the hub's sources (API replies, the
    sourced messages). In: the API replies, mirrored messages, the pulled tasks (to the
    env-gateway's inbox), and the hub's requests to make its source consumers on the region's
    outboxes. Nothing a region's client publishes reaches any other hub subject."""
    return Role(
        f"leaf-{region}",
        f"The leaf link of {region}'s server: mirrors the hub's weight streams and state, "
        "pulls tasks from its queue, answers its sources of the region's outboxes.",
        publish=(
            *_source_consumers(api_prefix(HUB_DOMAIN), MIRRORED),
            *HUB_TASK_PULLS,
            "$JSC.R.>",  # answers to the hub's API requests (its source consumers)
            "$JS.S.>",  # the messages its sources copy
        ),
        subscribe=(
            "$JSC.R.>",  # answers to the region's API requests (its mirror consumers)
            "$JS.M.>",  # the messages its mirrors copy
            "$LDS.>",  # loop detection
            f"{inbox_prefix('env-gateway')}.>",  # pulled tasks and their ack replies
            *_source_consumers(api_prefix(region), OUTBOX_NAMES),
        ),
    )


LEAF_ROLES = tuple(leaf_role(region) for region in REGIONS)
# Every user of the hub's server (deploy/nats/auth.conf): the clients and the regions' links.
ROLES: dict[str, Role] = {**_CLIENT_ROLES, **{role.name: role for role in LEAF_ROLES}}

# The users of a regional server (deploy/nats/region-auth.conf): its relay sets the region up
# and keeps the weight mirrors pruned; its env-gateway takes tasks and answers episodes; its
# workers roll out. Only the env-gateway's pulls from the hub's queue cross the link.
REGION_RELAY = _role(
    "relay",
    "A region's relay (region setup, relay-prune): creates and updates the mirrors of the "
    "weight streams and the trainer's state, the region's work queue and its outboxes; "
    "prunes the weight mirrors; reads weights and what the region holds.",
    publish=(
        *(
            subject
            for spec in MIRRORED_STREAMS
            for subject in (
                *ephemeral_reader(spec),
                f"{API}.STREAM.CREATE.{spec.name}",
                f"{API}.STREAM.UPDATE.{spec.name}",
                f"{API}.STREAM.PURGE.{spec.name}",
            )
        ),
        *(
            subject
            for name in (*(b for b in MIRRORED if b not in RELAYED_NAMES), *REGION_NAMES)
            for subject in (
                *stream_info(name),
                f"{API}.STREAM.CREATE.{name}",
                f"{API}.STREAM.UPDATE.{name}",
            )
        ),
        *(
            subject
            for spec in REGION_CONSUMERS
            for subject in (
                f"{API}.CONSUMER.DURABLE.CREATE.{spec.stream}.{spec.durable}",
                *consumer_lookup(spec),
            )
        ),
        # Where weights are read, the trainer's version and policy are looked up too.
        *STATE_READS,
    ),
)
REGION_ENV_GATEWAY = _role(
    "env-gateway",
    "A region's env-gateway: answers its workers' env requests (request/reply); its intake "
    "pulls tasks from the hub's queue across the link into the region's and looks up the "
    "region's backlog.",
    publish=(
        *HUB_TASK_PULLS,
        subjects.TASKS_ALL,
        *consumer_lookup(REGION_WORKER_TASKS),
    ),
    subscribe=(subjects.ENV_ALL,),
    allow_responses=True,
)
REGION_WORKER = _role(
    "rollout-worker",
    "A region's rollout-worker on its regional server: pulls the region's tasks, runs "
    "episodes against its env-gateway, publishes raw rollouts into its outbox; reads the "
    "mirrored weights and trainer's state, never writes them.",
    publish=(
        *durable_consumer(REGION_WORKER_TASKS),
        subjects.ROLLOUTS_RAW_ALL,
        subjects.ENV_ALL,
        *WEIGHT_READS,
        *STATE_READS,
    ),
    subscribe=(same_host.same_host_subject("*"),),
)
REGION_ROLES: dict[str, Role] = {
    role.name: role for role in (REGION_RELAY, REGION_ENV_GATEWAY, REGION_WORKER)
}

# The role each service connects as by default (a serve-only worker: serve-replica; the
# ingester's API: feedback-api, through its own connection).
SERVICE_ROLES: dict[str, str] = {
    "trainer": "trainer",
    "rollout-worker": "rollout-worker",
    "env-gateway": "env-gateway",
    "reward": "reward",
    "weight-broadcaster": "weight-broadcaster",
    "feedback-ingester": "feedback-ingester",
}
