"""The capacity controller's loop: read the fleet, decide, command, record.

    controller = CapacityController(ControllerConfig(replica_capacity_rps=4.0), bus)
    await controller.tick()          # one round (tests drive it); `run` loops every tick_s

Each tick reads every replica's heartbeat (libs/fleet/ledger.py), drops the stale ones
(older than `stale_s`: a replica that stopped reporting is neither counted nor commanded),
decides (libs/fleet/capacity.py), sends each command to its replica and records it on
RL_FLEET_DECISIONS as a FleetDecision with its reason, the load it was made on and the
replica's answer. A replica that accepted a command counts as having done it until its
heartbeat says so, for at most `settle_s` (its status may be a heartbeat old).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgspec
import structlog
from prometheus_client import Counter, Gauge

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.fleet.capacity import Decision, Memory, Plan, decide
from libs.fleet.config import ControllerConfig
from libs.fleet.ledger import new_command, read_statuses, send_command
from proto import subjects
from proto.fleet import FleetDecision, ReplicaRole, ReplicaStatus

log = structlog.get_logger(__name__)

LOAD = Gauge("rlpipe_fleet_load_requests_per_second", "Product requests/s across the fleet")
NEEDED = Gauge("rlpipe_fleet_replicas_needed", "Serving replicas the load needs")
REPLICAS = Gauge("rlpipe_fleet_replicas", "Serve replicas by role", ["role"])
DECISIONS = Counter("rlpipe_fleet_decisions_total", "Decisions by action and answer",
                    ["action", "accepted"])  # fmt: skip


@dataclass
class Sent:
    action: str
    at_s: float


class CapacityController:
    """Lends serve replicas to RL when product load allows, recalls them ahead of it."""

    def __init__(
        self,
        config: ControllerConfig,
        bus: Bus,
        *,
        stale_s: float = 15.0,
        settle_s: float = 10.0,
        command_timeout_s: float = 5.0,
    ) -> None:
        self.config = config
        self.bus = bus
        self.stale_s = stale_s
        self.settle_s = settle_s
        self.command_timeout_s = command_timeout_s
        self.memory = Memory()
        self.publisher = Publisher(bus.js)
        self.last_plan: Plan | None = None
        self.statuses: list[ReplicaStatus] = []
        self.num_decisions = 0
        self._sent: dict[str, Sent] = {}

    async def run(self, tick_s: float) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(tick_s)

    async def tick(self) -> Plan:
        now_s, utc_s = time.monotonic(), time.time()
        fresh = [s for s in await read_statuses(self.bus.js) if utc_s - s.at <= self.stale_s]
        self.statuses = [self._as_commanded(s, now_s) for s in fresh]
        plan = decide(self.statuses, self.config, self.memory, now_s, utc_s)
        self.last_plan = plan
        self._export(plan)
        for decision in plan.decisions:
            await self._carry_out(decision, plan)
        return plan

    def _as_commanded(self, status: ReplicaStatus, now_s: float) -> ReplicaStatus:
        """`status`, as the command it accepted will make it (until its heartbeat shows it)."""
        sent = self._sent.get(status.replica_id)
        if sent is None or now_s - sent.at_s > self.settle_s:
            return status
        lent = status.role in ("draining", "lending", "lent")
        if sent.action == "lend" and not lent and status.role == "serving":
            return msgspec.structs.replace(status, role="draining", ready=False)
        if sent.action == "recall" and lent:
            role: ReplicaRole = "recalling"
            return msgspec.structs.replace(status, role=role, ready=False)
        return status

    async def _carry_out(self, decision: Decision, plan: Plan) -> None:
        command = new_command(
            decision.replica_id, decision.action, decision.reason, "capacity-controller"
        )
        reply = await send_command(self.bus.nc, command, self.command_timeout_s)
        accepted = reply is not None and reply.accepted
        if accepted:
            self._sent[decision.replica_id] = Sent(decision.action, time.monotonic())
        record = FleetDecision(
            decision_id=uuid.uuid4().hex,
            action=decision.action,
            replica_id=decision.replica_id,
            reason=decision.reason,
            load_requests_per_s=plan.load_rps,
            forecast_requests_per_s=plan.forecast_rps,
            num_serving=plan.num_serving,
            num_needed=plan.num_needed,
            accepted=accepted,
            detail="no answer" if reply is None else reply.detail,
            decided_at=time.time(),
        )
        await self.publisher.publish(subjects.FLEET_DECISIONS, record, record.decision_id)
        self.num_decisions += 1
        DECISIONS.labels(decision.action, str(accepted).lower()).inc()
        log.info("fleet decision", action=decision.action, replica=decision.replica_id,
                 reason=decision.reason, accepted=accepted, detail=record.detail)  # fmt: skip

    def _export(self, plan: Plan) -> None:
        LOAD.set(plan.load_rps)
        NEEDED.set(plan.num_needed)
        roles = [s.role for s in self.statuses]
        for role in ("serving", "draining", "lending", "lent", "recalling", "restoring"):
            REPLICAS.labels(role).set(roles.count(role))

    def health(self) -> dict[str, object]:
        plan = self.last_plan
        return {
            "replicas": len(self.statuses),
            "serving": plan.num_serving if plan else 0,
            "lent": plan.num_lent if plan else 0,
            "needed": plan.num_needed if plan else 0,
            "load_requests_per_s": plan.load_rps if plan else 0.0,
            "decisions": self.num_decisions,
        }
