"""Regions: rollouts made beside a NATS server of their own, through a link outage.

A region runs its own nats-server (deploy/nats/region-leaf.conf): a leaf node of the training
cluster's server (the hub), with a JetStream domain of its own, named as the region. Its
services (env-gateway, rollout-workers, relay) connect to that server alone. What the region
needs from the hub is copied into its domain, and what it makes is copied back:

- weights and the trainer's state: the region's RL_WEIGHTS_ANNOUNCE, RL_WEIGHT_CHUNKS and
  KV_rl_state are mirrors of the hub's (each version crosses the link once per region);
- tasks: the region's env-gateway takes tasks from the hub's work queue (the shared consumer
  `rollout-worker`, as one more worker would) into the region's own, RL_REGION_TASKS, keeping
  up to a buffer of them there, and acks each on the hub once the region has stored it. (Its
  own name: an ack names the stream and consumer only, `$JS.ACK.<stream>.<consumer>...`, and
  the hub hears acks through the link, so a queue of the hub's name in the region would have
  each server take the other's acks.) A worker connected to a regional server takes its
  tasks there (libs/region/detect.py);
- rollouts and dead letters: written into the region's outboxes, which the hub's
  RL_ROLLOUTS_RAW and RL_DEAD_LETTERS source across the domains. While the link is down they
  wait in the region; when it returns the hub copies them on from where it stopped, and its
  duplicate window (message id = rollout id) drops any copy stored twice.

`libs/region/` sets this up and runs the task intake; proto/permissions.py grants the link and
the regional users exactly these subjects. Depends on nothing heavy.
"""

from __future__ import annotations

import msgspec

from proto import streams, subjects
from proto.streams import DAY_S, MIB, ConsumerSpec, KeyValueSpec, StreamSpec

# The hub's JetStream domain (deploy/nats/hub.conf): from a region, its API is `$JS.hub.API`.
HUB_DOMAIN = "hub"
# The regions the shipped hub config admits, each with its own leaf identity; a region's
# JetStream domain is its name (region-leaf.conf).
REGIONS = ("region-a",)

# A ring of what the region made: the hub holds what it copied, so the oldest go first and a
# link outage loses nothing while what the region makes meanwhile fits (the region stops
# making rollouts when its buffered tasks are done, so the task buffer bounds that).
ROLLOUTS_OUTBOX = StreamSpec(
    name="RL_ROLLOUTS_OUTBOX",
    subjects=(subjects.ROLLOUTS_RAW_ALL,),
    description="The region's raw rollouts; the hub's RL_ROLLOUTS_RAW sources them.",
    max_age_s=7 * DAY_S,
    max_bytes=1024 * MIB,
)
DEAD_LETTERS_OUTBOX = StreamSpec(
    name="RL_DEAD_LETTERS_OUTBOX",
    subjects=(subjects.DEAD_ALL,),
    description="What the region could not handle; the hub's RL_DEAD_LETTERS sources it.",
    max_age_s=30 * DAY_S,
    max_bytes=512 * MIB,
)
# The region's work queue: the hub's definition under the region's name, consumed as on the hub.
REGION_TASKS = msgspec.structs.replace(
    streams.TASKS,
    name="RL_REGION_TASKS",
    description="Tasks the region took from the hub's queue; each is handed to one worker.",
    # A task stored here whose ack to the hub the link lost is handed out again by the hub
    # once the link is back, however long it was down: it must still be known here then.
    duplicate_window_s=DAY_S,
)
REGION_WORKER_TASKS = msgspec.structs.replace(
    streams.ROLLOUT_WORKER_TASKS,
    stream=REGION_TASKS.name,
    description="Shared by the region's rollout workers: each task goes to one of them.",
)
REGION_STREAMS: tuple[StreamSpec, ...] = (REGION_TASKS, ROLLOUTS_OUTBOX, DEAD_LETTERS_OUTBOX)
REGION_CONSUMERS: tuple[ConsumerSpec, ...] = (REGION_WORKER_TASKS,)
# Each hub stream that sources a regional outbox, by the hub stream's name.
OUTBOXES: dict[str, StreamSpec] = {
    streams.ROLLOUTS_RAW.name: ROLLOUTS_OUTBOX,
    streams.DEAD_LETTERS.name: DEAD_LETTERS_OUTBOX,
}
# What the region mirrors from the hub.
MIRRORED_STREAMS: tuple[StreamSpec, ...] = (streams.WEIGHTS_ANNOUNCE, streams.WEIGHT_CHUNKS)
MIRRORED_BUCKETS: tuple[KeyValueSpec, ...] = (streams.STATE,)
# The hub's work queue, as the region's intake pulls from it.
HUB_TASKS = streams.ROLLOUT_WORKER_TASKS


def api_prefix(domain: str) -> str:
    """The JetStream API of `domain` as another domain reaches it: `$JS.<domain>.API`."""
    if not domain or not all(c.isalnum() or c in "-_" for c in domain):
        raise ValueError(
            f"JetStream domain {domain!r}: use the server's `jetstream.domain` (letters, "
            "digits, '-' and '_')"
        )
    return f"$JS.{domain}.API"


def bucket_stream(spec: KeyValueSpec) -> str:
    """The stream that holds a KV bucket: `KV_<bucket>`."""
    return f"KV_{spec.bucket}"
