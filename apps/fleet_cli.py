"""`rlpipe fleet`: the serving fleet's ledger, the capacity controller's decisions, and
lend/recall by hand.

    rlpipe fleet status                     # each serve replica: role, versions, load, loans
    rlpipe fleet status --json              # the same, one JSON object per replica
    rlpipe fleet decisions --last 20        # the newest decisions, with their reasons
    rlpipe fleet lend replica-2 --reason "maintenance window"
    rlpipe fleet recall replica-2

It connects as `rlpipe provision` does (RLPIPE_NATS_URL, RLPIPE_NATS_USER/PASSWORD, TLS
variables): the admin, or for `status` and `decisions` any user that may read the fleet
bucket and the decisions stream. A command by hand is recorded as a decision by `operator`;
the controller (`rlpipe run capacity-controller`) may undo it at its next tick unless it is
stopped. The work is libs/fleet/ledger.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

import msgspec

from libs.bus.connection import Bus, BusConnectError, connect_bus, options_from_environment
from libs.bus.publisher import Publisher
from libs.fleet.ledger import (
    format_decisions,
    format_ledger,
    new_command,
    read_decisions,
    read_statuses,
    send_command,
)
from proto import subjects
from proto.fleet import FleetAction, FleetDecision


def add_fleet_parser(commands: argparse._SubParsersAction) -> None:
    """Register `fleet` on an argparse subparsers object."""
    parser = commands.add_parser(
        "fleet",
        help="the serving fleet: what each replica serves, the controller's decisions",
        description="What each serve replica serves (role, versions, load, loans), the "
        "capacity controller's decisions, and lending or recalling a replica by hand.",
    )
    parser.add_argument(
        "--nats-url", default=os.environ.get("RLPIPE_NATS_URL", "nats://127.0.0.1:4222")
    )
    actions = parser.add_subparsers(dest="fleet_command", required=True)
    status = actions.add_parser("status", help="each replica's role, versions, load and loans")
    status.add_argument("--json", action="store_true", help="one JSON object per replica")
    decisions = actions.add_parser("decisions", help="the newest decisions and their reasons")
    decisions.add_argument("--last", type=int, default=20, help="how many (default 20)")
    for action in ("lend", "recall"):
        command = actions.add_parser(action, help=f"{action} one replica now (an operator's)")
        command.add_argument("replica", help="the replica's worker_id")
        command.add_argument("--reason", default="by hand", help="recorded with the decision")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except BusConnectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    options = options_from_environment(os.environ)
    bus = await connect_bus(args.nats_url, name="rlpipe-fleet", options=options)
    try:
        if args.fleet_command == "status":
            statuses = await read_statuses(bus.js)
            if args.json:
                print("\n".join(msgspec.json.encode(s).decode() for s in statuses))
            else:
                print(format_ledger(statuses, time.time()))
            return 0
        if args.fleet_command == "decisions":
            print(format_decisions(await read_decisions(bus.js, args.last)))
            return 0
        return await _command(bus, args.fleet_command, args.replica, args.reason)
    finally:
        await bus.close()


async def _command(bus: Bus, action: FleetAction, replica: str, reason: str) -> int:
    try:
        command = new_command(replica, action, reason, "operator")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reply = await send_command(bus.nc, command)
    accepted = reply is not None and reply.accepted
    detail = "no answer (is it running, with lending.enabled?)" if reply is None else reply.detail
    decision = FleetDecision(decision_id=uuid.uuid4().hex, action=action, replica_id=replica,
                             reason=reason, decided_by="operator", accepted=accepted,
                             detail=detail, decided_at=time.time())  # fmt: skip
    await Publisher(bus.js).publish(subjects.FLEET_DECISIONS, decision, decision.decision_id)
    print(f"{action} {replica}: {'accepted' if accepted else 'not accepted'} ({detail})")
    return 0 if accepted else 1
