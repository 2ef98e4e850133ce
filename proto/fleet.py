"""The serving fleet's contract: serve replicas lent to RL, and the capacity controller.

A serve replica with lending on (the rollout-worker's `lending.enabled`) publishes its
`ReplicaStatus` to the KV bucket `streams.FLEET` (key `replica_status_key(id)`) every
heartbeat and at every change of role, and answers `FleetCommand`s sent to
`fleet_command_subject(id)` (core NATS request/reply) with a `FleetCommandReply`. The
capacity controller reads the statuses, decides, sends the commands and records every
decision as a `FleetDecision` on `subjects.FLEET_DECISIONS` (stream RL_FLEET_DECISIONS).

Roles a replica moves through (`ReplicaRole`):

    serving --lend--> draining --> lending --> lent --recall--> recalling --> restoring --> serving

- serving: ready, answers product requests with the promoted version;
- draining: not ready (the load balancer takes it out), open product requests finish;
- lending: takes the trainer's newest version (the promoted one kept on the host);
- lent: pulls tasks and rolls them out;
- recalling: pulls nothing more; episodes in flight finish within a bound or go back to the
  task queue;
- restoring: the promoted version is written back and its hash checked; then serving.
A recall during draining or lending skips what is left of the lend.

Depends on nothing heavy (any process may import proto).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from proto.messages import Message
from proto.subjects import _token

ReplicaRole = Literal["serving", "draining", "lending", "lent", "recalling", "restoring"]
FleetAction = Literal["lend", "recall"]
# Roles in which a replica serves product users, or will again without a command.
RETURNING_ROLES: tuple[ReplicaRole, ...] = ("recalling", "restoring")
# Roles of a replica given to RL (or on its way there).
LENT_ROLES: tuple[ReplicaRole, ...] = ("draining", "lending", "lent")

FLEET_COMMAND_PREFIX = "rl.fleet.command"
REPLICA_STATUS_PREFIX = "replica."


def fleet_command_subject(replica_id: str) -> str:
    """Where replica `replica_id` takes its commands: `rl.fleet.command.<replica_id>`."""
    return f"{FLEET_COMMAND_PREFIX}.{_token(replica_id)}"


def replica_status_key(replica_id: str) -> str:
    """The replica's key in the fleet bucket: `replica.<replica_id>`."""
    return f"{REPLICA_STATUS_PREFIX}{_token(replica_id)}"


class FleetCommand(Message, kw_only=True):
    """Lend a serve replica to RL, or recall it to serving product users."""

    SCHEMA: ClassVar[str] = "fleet_command"

    command_id: str
    replica_id: str
    action: FleetAction
    reason: str = ""
    # Who sent it: `capacity-controller`, or `operator` (`rlpipe fleet lend|recall`).
    issued_by: str = ""
    issued_at: float = 0.0


class FleetCommandReply(Message, kw_only=True):
    """A replica's answer: whether it took the command, and its role now."""

    SCHEMA: ClassVar[str] = "fleet_command_reply"

    command_id: str
    replica_id: str
    accepted: bool
    role: ReplicaRole
    detail: str = ""


class ReplicaLoad(msgspec.Struct, kw_only=True):
    """Product traffic of one replica over its last `window_s` seconds."""

    window_s: float
    # Product requests that arrived per second (answered or not).
    requests_per_s: float = 0.0
    # Open requests now: generating, and waiting for a slot (admission control's queue).
    running: int = 0
    queued: int = 0
    # Latency of the requests answered in the window (None: none answered).
    p50_latency_s: float | None = None
    p99_latency_s: float | None = None
    # Answers with a 5xx status in the window.
    errors: int = 0


class RecallRecord(msgspec.Struct, kw_only=True):
    """What one recall did to the episodes in flight, and how long the way back took."""

    tasks_in_flight: int = 0
    # Finished within the bound, their rollouts published; the rest went back to the queue.
    tasks_finished: int = 0
    tasks_requeued: int = 0
    episodes_finished: int = 0
    episodes_requeued: int = 0
    requeued_task_ids: list[str] = msgspec.field(default_factory=list)
    # Seconds from the command to ready again.
    seconds: float = 0.0
    # The restored weights' hash equals the promoted version's (signed) hash.
    restored_version: int | None = None
    restored_hash: str = ""
    hash_matches: bool = False


class ReplicaStatus(Message, kw_only=True):
    """A serve replica's heartbeat: what it serves (role, versions), its load, its lends."""

    SCHEMA: ClassVar[str] = "replica_status"

    replica_id: str
    role: ReplicaRole
    # In the load balancer: serving, weights usable, not stopping.
    ready: bool
    # The version the engine generates with now (a trainer version while lent).
    policy_version: int | None = None
    # The promoted version it serves product users with, and restores after a loan.
    promoted_version: int | None = None
    load: ReplicaLoad
    # Tasks and episodes being rolled out now (lent).
    tasks_in_flight: int = 0
    episodes_in_flight: int = 0
    num_lends: int = 0
    num_recalls: int = 0
    tasks_done_lent: int = 0
    # Seconds the last lend took from the command to pulling tasks (None: never lent).
    last_lend_s: float | None = None
    last_recall: RecallRecord | None = None
    detail: str = ""
    at: float = 0.0


class FleetDecision(Message, kw_only=True):
    """One decision of the capacity controller (or an operator's command), with its reason
    and the load it was made on; `accepted` is the replica's answer."""

    SCHEMA: ClassVar[str] = "fleet_decision"

    decision_id: str
    action: FleetAction
    replica_id: str
    reason: str
    decided_by: str = "capacity-controller"
    # Product requests/s on the serving replicas, and what the controller expects within
    # its recall lead time.
    load_requests_per_s: float = 0.0
    forecast_requests_per_s: float = 0.0
    # Replicas serving product users (or returning to) before, and how many it wants.
    num_serving: int = 0
    num_needed: int = 0
    accepted: bool = False
    detail: str = ""
    decided_at: float = 0.0
