"""Stream, consumer and KV definitions: what the bus provisions, in one place.

These are plain data; `libs.bus.provision` turns them into JetStream API calls.

Every stream and bucket is bounded (`max_bytes`, or `max_msgs` for the weight chunks), so
no producer, flood or stuck consumer fills the server's disk. JetStream reserves each
stream's `max_bytes` against the server's `max_file_store` (by default 75% of the free disk
when it starts), so the figures fit one machine: the sum is about 6 GiB. What happens at a
limit is each one's `discard`:
- "new" (work queues, weights, KV buckets): the publish that would pass the limit is refused
  with an error; the publisher retries and then fails loudly (a 503, a nak, a dead service),
  and nothing stored is lost. Those streams empty as they are consumed or pruned, so
  reaching the limit means a consumer is down.
- "old" (logs: generations, feedback, samples, scored rollouts, dead letters, promotions):
  the oldest messages are dropped to make room; readers past them lose nothing, a reader
  still behind them skips them.
docs/architecture.md#storage-limits lists the figures.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from proto import subjects

DAY_S = 24 * 3600.0
MIB = 1024 * 1024
GIB = 1024 * MIB
# Exactly-once by construction: a message redelivered after a crash between publish and ack
# is republished within its first copy's duplicate window, so it is dropped as a duplicate.
# A consumer redelivers at most ack_wait after its last in-progress ack, and a failing
# handler at most max_deliver times with naks of up to 30 s in between: with ack_wait <= 30 s
# and max_deliver 5 that is under 5 * (30 + 30) = 300 s. Streams that services publish to
# keep ids for twice that (tests/test_bus.py checks every consumer against every stream).
REDELIVERY_WINDOW_S = 10 * 60.0
MAX_ACK_WAIT_S = 30.0


class StreamSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A JetStream stream."""

    name: str
    subjects: tuple[str, ...]
    description: str
    retention: Literal["limits", "workqueue", "interest"] = "limits"
    storage: Literal["file", "memory"] = "file"
    max_age_s: float = 7 * DAY_S
    # Every stream of proto/ has a size bound (-1: none, for a test's own streams);
    # `discard` says what happens at it (module docstring).
    max_bytes: int = -1
    max_msgs: int = -1
    max_msg_bytes: int = -1
    # Window in which a repeated Nats-Msg-Id is dropped as a duplicate.
    duplicate_window_s: float = REDELIVERY_WINDOW_S
    discard: Literal["old", "new"] = "old"
    allow_direct: bool = False


class ConsumerSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A durable pull consumer on a stream."""

    stream: str
    durable: str
    description: str
    filter_subject: str | None = None
    # Time a delivered message may stay unacked before redelivery (handlers extend it
    # with in-progress acks while they work): also how long the work a dead process held
    # waits before another takes it, so short.
    ack_wait_s: float = 15.0
    # Attempts a handler gets before the message is dead-lettered (see libs.bus.consume).
    max_deliver: int = 5
    max_ack_pending: int = 1000


class KeyValueSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A KV bucket for live state. At `max_bytes` a write of a new value is refused (a KV
    bucket discards new), so whoever writes it sees an error instead of losing old keys."""

    bucket: str
    description: str
    max_bytes: int = -1
    history: int = 1
    storage: Literal["file", "memory"] = "file"
    # Reads by direct get (any replica answers; no JetStream API round trip to the leader).
    direct: bool = False


TASKS = StreamSpec(
    name="RL_TASKS",
    subjects=(subjects.TASKS_ALL,),
    description="Tasks to roll out; each is handed to one worker.",
    retention="workqueue",
    max_bytes=256 * MIB,
    discard="new",
)
ROLLOUTS_RAW = StreamSpec(
    name="RL_ROLLOUTS_RAW",
    subjects=(subjects.ROLLOUTS_RAW_ALL,),
    description="Finished episodes waiting for the reward service.",
    retention="workqueue",
    max_bytes=1 * GIB,
    discard="new",
)
ROLLOUTS_SCORED = StreamSpec(
    name="RL_ROLLOUTS_SCORED",
    subjects=(subjects.ROLLOUTS_SCORED,),
    description="Scored episodes for the trainer; kept so a resumed trainer can replay.",
    max_bytes=1 * GIB,
)
WEIGHTS_STAGED = StreamSpec(
    name="RL_WEIGHTS_STAGED",
    subjects=(subjects.WEIGHTS_STAGED,),
    description="Weight versions the trainer staged on disk, for the weight-broadcaster.",
    retention="workqueue",
    max_bytes=64 * MIB,
    discard="new",
)
# The weight-broadcaster deletes what no one needs (everything before the latest snapshot);
# no age limit, or a long pause in training would expire the only snapshot.
WEIGHTS_ANNOUNCE = StreamSpec(
    name="RL_WEIGHTS_ANNOUNCE",
    subjects=(subjects.WEIGHTS_ANNOUNCE_ALL,),
    description="Announcements of stored policy versions (deltas and snapshots).",
    max_age_s=0.0,
    allow_direct=True,
    max_bytes=256 * MIB,
    discard="new",
)
WEIGHT_CHUNKS = StreamSpec(
    name="RL_WEIGHT_CHUNKS",
    subjects=(subjects.WEIGHT_CHUNKS_ALL,),
    description="Encoded weight chunks, one subject per chunk, read by direct get.",
    max_age_s=0.0,
    max_msg_bytes=8 * MIB,
    allow_direct=True,
    # The broadcaster prunes it (everything before the latest snapshot), so it holds one or
    # two snapshots and their deltas: far more bytes than any fixed budget that fits a
    # laptop's disk, which JetStream would reserve. A bound in messages instead (each at most
    # max_msg_bytes); the server's own max_file_store bounds the bytes.
    max_msgs=1_000_000,
    discard="new",
)
SERVING_GENERATIONS = StreamSpec(
    name="RL_SERVING_GENERATIONS",
    subjects=(subjects.SERVING_GENERATIONS,),
    description="Generations served to product users, for joining with feedback.",
    max_bytes=1 * GIB,
    # The join reads a generation by its sequence for every sample it makes.
    allow_direct=True,
)
FEEDBACK_EVENTS = StreamSpec(
    name="RL_FEEDBACK_EVENTS",
    subjects=(subjects.FEEDBACK_EVENTS,),
    description="Feedback events posted by the product.",
    # A client retrying an event within a day must not create it twice.
    duplicate_window_s=DAY_S,
    max_bytes=1 * GIB,
)
ROLLOUTS_ONLINE = StreamSpec(
    name="RL_ROLLOUTS_ONLINE",
    subjects=(subjects.ROLLOUTS_ONLINE,),
    description="Served generations joined with feedback: online training samples.",
    max_bytes=1 * GIB,
)
# Decisions are few and small, and the last one says what serves: no age limit.
PROMOTIONS = StreamSpec(
    name="RL_PROMOTIONS",
    subjects=(subjects.PROMOTIONS,),
    description="The trainer's eval-gate decisions: versions promoted to serving or rejected.",
    max_age_s=0.0,
    max_bytes=16 * MIB,
)
# The capacity controller's decisions (proto/fleet.py): a few a day, each small; a month of
# them says why the fleet served what it did.
FLEET_DECISIONS = StreamSpec(
    name="RL_FLEET_DECISIONS",
    subjects=(subjects.FLEET_DECISIONS,),
    description="The capacity controller's lends and recalls of serve replicas, with reasons.",
    max_age_s=30 * DAY_S,
    max_bytes=16 * MIB,
)
DEAD_LETTERS = StreamSpec(
    name="RL_DEAD_LETTERS",
    subjects=(subjects.DEAD_ALL,),
    description="Messages no handler could process, with the reason in headers.",
    max_age_s=30 * DAY_S,
    max_bytes=512 * MIB,
)

ALL_STREAMS: tuple[StreamSpec, ...] = (
    TASKS,
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    WEIGHTS_STAGED,
    WEIGHTS_ANNOUNCE,
    WEIGHT_CHUNKS,
    SERVING_GENERATIONS,
    FEEDBACK_EVENTS,
    ROLLOUTS_ONLINE,
    PROMOTIONS,
    FLEET_DECISIONS,
    DEAD_LETTERS,
)

ROLLOUT_WORKER_TASKS = ConsumerSpec(
    stream=TASKS.name,
    durable="rollout-worker",
    description="Shared by all rollout workers: each task goes to one of them.",
    # A group of long episodes can take minutes; workers send in-progress acks (every
    # ack_wait / 3), so a short wait costs nothing and a dead worker's tasks move on quickly.
    ack_wait_s=MAX_ACK_WAIT_S,
    max_ack_pending=256,
)
REWARD_ROLLOUTS = ConsumerSpec(
    stream=ROLLOUTS_RAW.name,
    durable="reward",
    description="Reward scores every raw rollout.",
    ack_wait_s=MAX_ACK_WAIT_S,
)
# The trainer has no durable consumer: it reads ROLLOUTS_SCORED (and ROLLOUTS_ONLINE) from
# the position stored in its own checkpoint (libs.trainer.cursor), so the model and how far
# it consumed are saved together and a resume neither loses nor repeats a sample.
JOINER_GENERATIONS = ConsumerSpec(
    stream=SERVING_GENERATIONS.name,
    durable="feedback-joiner-generations",
    description="Served generations, joined with feedback.",
)
JOINER_FEEDBACK = ConsumerSpec(
    stream=FEEDBACK_EVENTS.name,
    durable="feedback-joiner-events",
    description="Feedback events, joined with served generations.",
)

WEIGHT_BROADCASTER_STAGED = ConsumerSpec(
    stream=WEIGHTS_STAGED.name,
    durable="weight-broadcaster",
    description="Staged versions, encoded one at a time and in order.",
    # Encoding a large model takes minutes; the handler sends in-progress acks meanwhile.
    # Short: one version at a time, so a dead broadcaster's version blocks all later ones
    # until it is redelivered.
    ack_wait_s=10.0,
    max_ack_pending=1,
)

ALL_CONSUMERS: tuple[ConsumerSpec, ...] = (
    ROLLOUT_WORKER_TASKS,
    REWARD_ROLLOUTS,
    JOINER_GENERATIONS,
    JOINER_FEEDBACK,
    WEIGHT_BROADCASTER_STAGED,
)

STATE = KeyValueSpec(
    bucket="rl_state",
    description="Live state: current policy version, heartbeats, run config.",
    max_bytes=64 * MIB,
)

# Keys of STATE the trainer writes (ASCII decimal integers) and the feeder reads.
POLICY_VERSION_KEY = "policy_version"
# Groups the trainer has taken from the scored stream, trained or dropped as stale.
GROUPS_TAKEN_KEY = "trainer_groups_taken"
# The trainer's groups per optimizer step: the feeder's batch (sync) and its unit of run-ahead.
BATCH_GROUPS_KEY = "trainer_batch_groups"
# The trainer's staleness bound (updates a sample's weights may lag the trainer's): the feeder
# tags async tasks so no worker generates them with weights already past it.
MAX_STALENESS_KEY = "trainer_max_staleness"
# The version the trainer's eval gate last promoted to serving (serving replicas follow it).
PROMOTED_VERSION_KEY = "promoted_policy_version"
# The trainer's PolicyIdentity (msgpack): what workers check their own policy against.
POLICY_IDENTITY_KEY = "policy_identity"
# Keys the env-gateway's task feeder keeps its position under: `task_feeder.<env>`.
TASK_FEEDER_KEY_PREFIX = "task_feeder."

# The feedback join's state (libs/feedback/join.py): generations by id (with the events
# each admitted to training), one key per event waiting for its generation, and each API
# key's budget of training samples; every key with a per-key TTL (nats-server >= 2.11), so
# the bucket holds about one join window of traffic. Provisioned with the rest, so the
# ingester needs no right to create buckets.
FEEDBACK_JOIN = KeyValueSpec(
    bucket="feedback_join",
    description="Feedback join: generation index, events waiting for one, sample budgets.",
    max_bytes=512 * MIB,
    direct=True,
)
# The feedback API's rate limit, one token bucket per API key shared by every replica
# (libs/feedback/rate_limit.py). Memory: a restart of the server refills every bucket.
FEEDBACK_RATE = KeyValueSpec(
    bucket="feedback_rate",
    description="Feedback API: each API key's rate-limit bucket, shared by every replica.",
    max_bytes=16 * MIB,
    storage="memory",
    direct=True,
)

# The serving fleet's live state (proto/fleet.py): each lendable serve replica's status,
# key `replica.<id>`, put every heartbeat. Memory: a restarted server is repopulated within
# one heartbeat.
FLEET = KeyValueSpec(
    bucket="rl_fleet",
    description="Serving fleet: each serve replica's role, versions, load and loans.",
    max_bytes=16 * MIB,
    storage="memory",
)

ALL_KV: tuple[KeyValueSpec, ...] = (STATE, FEEDBACK_JOIN, FEEDBACK_RATE, FLEET)
