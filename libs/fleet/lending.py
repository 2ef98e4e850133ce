"""A serve replica's side of lending: commands, the way to RL and back, heartbeats.

    lending = Lending(LendingConfig(enabled=True), "replica-1", parts, meter, open_requests)
    await lending.start(bus)            # answers rl.fleet.command.replica-1, first heartbeat
    await lending.run()                 # heartbeats and loans, until cancelled
    lending.accepting                   # product requests are admitted now
    lending.ready                       # in the load balancer

A `lend` command (proto/fleet.py) starts a loan; a `recall` ends it, at any step:

    serving -> draining   readiness off; product requests still answered for
                          `unready_grace_s` (the load balancer's delay), then refused (503,
                          retry elsewhere); open ones finish (at most `drain_timeout_s`, else
                          the loan is given up and the replica serves on)
            -> lending    the promoted version's host copy is held; the trainer's newest
                          version is taken (libs/fleet/loan.py; at most `weights_timeout_s`)
            -> lent       tasks are pulled and rolled out
    recall  -> recalling  no more tasks; those in flight finish within `recall_grace_s` or
                          go back to the queue
            -> restoring  the promoted version is copied back and its hash checked
            -> serving    ready again

Product traffic always wins: a recall interrupts a lend at whatever step it is, and the
replica answers no product request with any weights but the promoted version's. Every
change of role is put to the fleet bucket at once (and every `heartbeat_s` anyway), with
the load (libs/fleet/load_meter.py) the controller decides from.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from libs.bus import wire
from libs.bus.connection import Bus
from libs.fleet.config import LendingConfig
from libs.fleet.load_meter import LoadMeter
from libs.fleet.loan import Loan, ReplicaParts
from libs.rollout.weights_follower import WeightsFollower
from proto import streams
from proto.fleet import (
    LENT_ROLES,
    FleetCommand,
    FleetCommandReply,
    RecallRecord,
    ReplicaRole,
    ReplicaStatus,
    fleet_command_subject,
    replica_status_key,
)

log = structlog.get_logger(__name__)
T = TypeVar("T")

ROLE = Gauge("rlpipe_fleet_replica_lent", "1 while this serve replica is lent (or on its way)")
LOANS = Counter("rlpipe_fleet_loans_total", "Loans of this replica by outcome", ["outcome"])
EPISODES_AT_RECALL = Counter(
    "rlpipe_fleet_recall_episodes_total", "Episodes in flight at a recall by fate", ["fate"]
)
LEND_SECONDS = Gauge("rlpipe_fleet_last_lend_seconds", "Last lend: command to pulling tasks")
RECALL_SECONDS = Gauge("rlpipe_fleet_last_recall_seconds", "Last recall: command to ready")
# What a stopping replica waits, past the recall grace, for its loan to end: the restore's
# copy and hash take seconds even for a large model.
STOP_RESTORE_S = 60.0
HISTORY = 1000


class Recalled(Exception):
    """A recall came while the replica was on its way to RL."""


class LoanGivenUp(Exception):
    """A step of a lend ran past its bound: the replica serves on."""


class Lending:
    """Takes lend and recall commands and moves the replica between serving and RL."""

    def __init__(
        self,
        config: LendingConfig,
        replica_id: str,
        parts: ReplicaParts,
        meter: LoadMeter,
        open_requests: Callable[[], tuple[int, int]],
    ) -> None:
        self.config = config
        self.replica_id = replica_id
        self.parts = parts
        self.meter = meter
        self.open_requests = open_requests  # product requests (running, queued) now
        self.role: ReplicaRole = "serving"
        self.accepting = True
        self.detail = ""
        self.loan: Loan | None = None
        self.num_lends = 0
        self.num_recalls = 0
        self.num_tasks_done = 0
        self.last_lend_s: float | None = None
        self.last_recall: RecallRecord | None = None
        # Every loan's lend time and recall record (the last HISTORY of each).
        self.lend_seconds: deque[float] = deque(maxlen=HISTORY)
        self.recalls: deque[RecallRecord] = deque(maxlen=HISTORY)
        self._lend_asked = asyncio.Event()
        self._recall_asked = asyncio.Event()
        self._kv: KeyValue | None = None
        self._bus: Bus | None = None
        self._subscription: Any = None
        self._holding = contextlib.AsyncExitStack()  # the promoted version, held by a loan

    @property
    def ready(self) -> bool:
        return self.role == "serving" and self.parts.follower.usable

    @property
    def version_follower(self) -> WeightsFollower:
        """The follower whose versions the engine generates with now."""
        return self.loan.follower if self.loan is not None else self.parts.follower

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._kv = await bus.js.key_value(streams.FLEET.bucket)
        subject = fleet_command_subject(self.replica_id)
        self._subscription = await bus.nc.subscribe(subject, cb=self._on_command)
        await self.heartbeat()
        log.info("lendable: taking fleet commands", subject=subject)

    async def run(self) -> None:
        """Heartbeats and loans until cancelled (a loan that cannot restore raises)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._beat())
            group.create_task(self._drive())

    async def stop(self) -> None:
        """Take no more commands; a loan ends as a recall does (its tasks in flight finish
        or go back to the queue), while `run` still runs."""
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()
        self._lend_asked.clear()
        if self.role == "serving":
            return
        self._recall_asked.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.recall_grace_s + STOP_RESTORE_S):
                while self.role != "serving":
                    await asyncio.sleep(0.05)

    # ---- commands ---------------------------------------------------------------------------

    async def _on_command(self, msg: Msg) -> None:
        try:
            command = wire.decode(FleetCommand, msg.data, dict(msg.headers or {}))
        except wire.InvalidMessage as exc:
            log.warning("fleet command refused", error=str(exc))
            reply = self._reply("", False, f"not a fleet command: {exc}")
        else:
            reply = self.on_command(command)
        if self._bus is not None and msg.reply:  # (Msg.respond would echo the request's headers)
            headers = wire.headers_for(reply, reply.command_id)
            with contextlib.suppress(nats.errors.Error):
                await self._bus.nc.publish(msg.reply, wire.encode(reply), headers=headers)

    def on_command(self, command: FleetCommand) -> FleetCommandReply:
        """Take `command` (or say why not); the transition runs in `run`."""
        accepted, detail = True, ""
        if command.replica_id != self.replica_id:
            accepted, detail = False, f"this is {self.replica_id}, not {command.replica_id}"
        elif command.action == "lend":
            accepted, detail = self._take_lend()
        elif self.role in LENT_ROLES:
            self._recall_asked.set()
            detail = "recalling"
        elif self._lend_asked.is_set():  # lent a moment ago, not on its way yet
            self._lend_asked.clear()
            detail = "lend withdrawn"
        else:
            detail = "not lent" if self.role == "serving" else "already on its way back"
        log.info("fleet command", action=command.action, by=command.issued_by,
                 reason=command.reason, accepted=accepted, detail=detail)  # fmt: skip
        return self._reply(command.command_id, accepted, detail)

    def _reply(self, command_id: str, accepted: bool, detail: str) -> FleetCommandReply:
        return FleetCommandReply(
            command_id=command_id,
            replica_id=self.replica_id,
            accepted=accepted,
            role=self.role,
            detail=detail,
        )

    def _take_lend(self) -> tuple[bool, str]:
        if self.role in LENT_ROLES:
            return True, "already lent"
        if self.role != "serving":
            return False, f"{self.role}: returning from a loan; ask again once serving"
        if not self.ready:
            return False, "not ready (no promoted version yet)"
        self._recall_asked.clear()
        self._lend_asked.set()
        return True, "lending"

    # ---- loans ------------------------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            await self._lend_asked.wait()
            self._lend_asked.clear()
            asked_at = time.monotonic()
            self.detail = ""
            try:
                await self._lend(asked_at)
                await self._until_recalled(self._loan_ended_badly())
            except Recalled:
                pass
            except LoanGivenUp as exc:
                LOANS.labels("given_up").inc()
                log.warning("loan given up; serving on", reason=str(exc))
                self.detail = f"last loan given up: {exc}"
            await self._end_loan(time.monotonic())

    async def _lend(self, asked_at: float) -> None:
        await self._set_role("draining")
        await self._until_recalled(asyncio.sleep(self.config.unready_grace_s))
        self.accepting = False  # from now on product requests are answered 503
        await self._until_recalled(self._drained(), self.config.drain_timeout_s, "draining")
        await self._set_role("lending")
        await self._until_recalled(self._hold_promotions())
        held = self.parts.follower.promoted_copy()
        if held is None:
            raise LoanGivenUp("the engine does not hold its promoted version's host copy")
        self.loan = Loan(self.parts, *held)
        state_js = self._bus.js if self._bus is not None else None
        wait_s = self.config.weights_timeout_s
        await self._until_recalled(self.loan.take_weights(state_js), wait_s, "the weights")
        self.loan.pull_tasks()
        self.num_lends += 1
        self.last_lend_s = time.monotonic() - asked_at
        self.lend_seconds.append(self.last_lend_s)
        LEND_SECONDS.set(self.last_lend_s)
        LOANS.labels("lent").inc()
        await self._set_role("lent")

    async def _drained(self) -> None:
        """Until no product request is open (they all finished)."""
        while sum(self.open_requests()) or self.parts.batcher.num_served_in_engine:
            await asyncio.sleep(0.05)

    async def _hold_promotions(self) -> None:
        """Hold the promoted version as it is until the loan ends (`_end_loan` lets go)."""
        await self._holding.enter_async_context(self.parts.follower.promotions)

    async def _loan_ended_badly(self) -> None:
        assert self.loan is not None
        await self.loan.ended_badly()

    async def _until_recalled(
        self, work: Awaitable[T], timeout_s: float | None = None, what: str = ""
    ) -> T:
        """What `work` returns, unless a recall comes first (Recalled) or `timeout_s` passes
        (LoanGivenUp)."""
        task = asyncio.ensure_future(work)
        recall = asyncio.ensure_future(self._recall_asked.wait())
        try:
            done, _ = await asyncio.wait(
                {task, recall}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            recall.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task in done:
            return task.result()
        if recall in done:
            raise Recalled()
        raise LoanGivenUp(f"{what} took over {timeout_s:.0f} s")

    async def _end_loan(self, asked_at: float) -> None:
        """Back to serving: end the loan (if it got that far), let go of the promoted
        version, turn ready."""
        recalled = self._recall_asked.is_set()
        loan, record = self.loan, RecallRecord()
        if loan is not None:
            await self._set_role("recalling")
            await loan.finish_tasks(self.config.recall_grace_s)
            await self._set_role("restoring")
            record = await loan.restore()
            self.num_tasks_done += loan.num_tasks_done
            self.loan = None
        await self._holding.aclose()  # the promoted version may move on again
        self._recall_asked.clear()
        self.accepting = True
        record.seconds = round(time.monotonic() - asked_at, 3)
        if recalled:
            self.num_recalls += 1
            if loan is not None:
                self._recalled(record)
            else:  # its weights never changed: nothing to restore or record
                log.info("lend withdrawn before the loan began", seconds=record.seconds)
        await self._set_role("serving")

    def _recalled(self, record: RecallRecord) -> None:
        self.last_recall = record
        self.recalls.append(record)
        RECALL_SECONDS.set(record.seconds)
        EPISODES_AT_RECALL.labels("finished").inc(record.episodes_finished)
        EPISODES_AT_RECALL.labels("requeued").inc(record.episodes_requeued)
        log.info("recalled", seconds=record.seconds, finished=record.tasks_finished,
                 requeued=record.tasks_requeued, hash_matches=record.hash_matches)  # fmt: skip

    # ---- heartbeats -------------------------------------------------------------------------

    async def _set_role(self, role: ReplicaRole) -> None:
        if role == self.role:
            return
        log.info("fleet role", role=role, was=self.role)
        self.role = role
        ROLE.set(1 if role in LENT_ROLES else 0)
        await self.heartbeat()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            await self.heartbeat()

    async def heartbeat(self) -> None:
        """Put this replica's status to the fleet bucket (a failure is logged, not fatal)."""
        if self._kv is None:
            return
        try:
            await self._kv.put(replica_status_key(self.replica_id), wire.encode(self.status()))
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("fleet heartbeat not stored", error=repr(exc))

    def status(self) -> ReplicaStatus:
        follower = self.parts.follower
        running, queued = self.open_requests()
        loan = self.loan
        held = loan.held.version if loan is not None else follower.policy_version
        return ReplicaStatus(
            replica_id=self.replica_id,
            role=self.role,
            ready=self.ready,
            policy_version=self.version_follower.policy_version,
            promoted_version=held,
            load=self.meter.load(running, queued),
            tasks_in_flight=len(loan.in_flight) if loan is not None else 0,
            episodes_in_flight=loan.episodes_in_flight if loan is not None else 0,
            num_lends=self.num_lends,
            num_recalls=self.num_recalls,
            tasks_done_lent=self.num_tasks_done + (loan.num_tasks_done if loan else 0),
            last_lend_s=None if self.last_lend_s is None else round(self.last_lend_s, 3),
            last_recall=self.last_recall,
            detail=self.detail,
            at=time.time(),
        )

    def health(self) -> dict[str, Any]:
        status = self.status()
        return {
            "fleet_role": status.role,
            "ready": status.ready,
            "fleet_lends": status.num_lends,
            "fleet_recalls": status.num_recalls,
            "fleet_tasks_done_lent": status.tasks_done_lent,
        }
