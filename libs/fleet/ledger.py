"""What each serve replica serves, and what the controller decided: read from the bus.

    statuses = await read_statuses(js)              # every replica's last heartbeat
    print(format_ledger(statuses, time.time()))     # `rlpipe fleet status`
    decisions = await read_decisions(js, last=20)   # the newest decisions, oldest first
    print(format_decisions(decisions))              # `rlpipe fleet decisions`
    reply = await send_command(nc, new_command("replica-2", "recall", "peak", "operator"))

The ledger is the fleet bucket (proto.streams.FLEET): one key per replica, its role, the
version it generates with and the promoted version it serves product users with, its load
and its loans. Decisions are the RL_FLEET_DECISIONS stream.
"""

from __future__ import annotations

import time
import uuid

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError

from libs.bus import wire
from proto import streams
from proto.fleet import (
    REPLICA_STATUS_PREFIX,
    FleetAction,
    FleetCommand,
    FleetCommandReply,
    FleetDecision,
    ReplicaStatus,
    fleet_command_subject,
)

COMMAND_TIMEOUT_S = 5.0


async def read_statuses(js: JetStreamContext) -> list[ReplicaStatus]:
    """Every replica's last status in the fleet bucket, by replica id (none: [])."""
    try:
        kv = await js.key_value(streams.FLEET.bucket)
        keys = await kv.keys()
    except (NoKeysError, BucketNotFoundError):
        return []
    statuses = []
    for key in sorted(k for k in keys if k.startswith(REPLICA_STATUS_PREFIX)):
        try:
            entry = await kv.get(key)
            statuses.append(wire.decode(ReplicaStatus, entry.value or b"", None))
        except (wire.InvalidMessage, NotFoundError):
            continue  # gone since listed, or not a status: the ledger shows the rest
    return statuses


async def read_decisions(js: JetStreamContext, last: int = 20) -> list[FleetDecision]:
    """The newest `last` decisions on the decisions stream, oldest first."""
    name = streams.FLEET_DECISIONS.name
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return []
    if not info.state.messages:
        return []
    first = max(info.state.first_seq, info.state.last_seq - last + 1)
    decisions = []
    for seq in range(first, info.state.last_seq + 1):
        try:
            raw = await js.get_msg(name, seq)
            decisions.append(wire.decode(FleetDecision, raw.data or b"", dict(raw.headers or {})))
        except (wire.InvalidMessage, NotFoundError):
            continue
    return decisions


def new_command(replica_id: str, action: FleetAction, reason: str, by: str) -> FleetCommand:
    return FleetCommand(
        command_id=uuid.uuid4().hex,
        replica_id=replica_id,
        action=action,
        reason=reason,
        issued_by=by,
        issued_at=time.time(),
    )


async def send_command(
    nc: Client, command: FleetCommand, timeout_s: float = COMMAND_TIMEOUT_S
) -> FleetCommandReply | None:
    """The replica's answer to `command`, or None when none came in time (it is down, or
    does not take commands)."""
    subject = fleet_command_subject(command.replica_id)
    try:
        msg = await nc.request(subject, wire.encode(command), timeout=timeout_s,
                               headers=wire.headers_for(command, command.command_id))  # fmt: skip
        return wire.decode(FleetCommandReply, msg.data, dict(msg.headers or {}))
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, wire.InvalidMessage):
        return None


def format_ledger(statuses: list[ReplicaStatus], now: float) -> str:
    """One line per replica: role, readiness, versions, load, loans, age of the status."""
    if not statuses:
        return "no serve replica has reported (lending.enabled on none, or none running)"
    header = ("replica", "role", "ready", "version", "promoted", "req/s", "p99 s", "queued",
              "episodes", "lends", "recalls", "seen")  # fmt: skip
    rows = [header]
    for s in statuses:
        p99 = "-" if s.load.p99_latency_s is None else f"{s.load.p99_latency_s:.3f}"
        rows.append((s.replica_id, s.role, "yes" if s.ready else "no", _text(s.policy_version),
                     _text(s.promoted_version), f"{s.load.requests_per_s:.2f}", p99,
                     str(s.load.queued), str(s.episodes_in_flight), str(s.num_lends),
                     str(s.num_recalls), f"{max(0.0, now - s.at):.0f} s ago"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def format_decisions(decisions: list[FleetDecision]) -> str:
    if not decisions:
        return "no fleet decisions recorded"
    lines = []
    for d in decisions:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.decided_at))
        outcome = "accepted" if d.accepted else f"not accepted ({d.detail or 'no answer'})"
        lines.append(f"{when}Z  {d.action:<6} {d.replica_id}  by {d.decided_by}: {d.reason}"
                     f"  [{outcome}]")  # fmt: skip
    return "\n".join(lines)


def _text(value: int | None) -> str:
    return "-" if value is None else str(value)
