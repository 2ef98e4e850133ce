"""The region's task intake: tasks taken from the hub's work queue into the region's own.

A region's env-gateway runs it (`intake.hub_domain` set, its feeder off). It keeps the
region's RL_REGION_TASKS (consumer `rollout-worker`: tasks waiting plus tasks in progress) at
`buffer_tasks`, pulling what is missing from the hub's RL_TASKS through the leaf link, from
the consumer every worker shares: the region takes tasks as it has room, as one more worker
would, and the hub's feeder paces them all (its staleness bound covers the region's buffer).
Each task is stored in the region first (same subject, payload and headers, so its message id
is its task id) and then acked on the hub, so none is lost: a crash between the two makes the
hub deliver it again, and the region's duplicate window drops the copy.

While the link is down the pull finds no hub (the server answers at once): the intake waits
and tries again every `poll_interval_s`, and the region's workers keep rolling out what is
buffered. One window remains: a task stored in the region whose ack was lost with the link
is handed out again by the hub after its ack wait. Its rollouts carry the same ids (the task
id and the sample index), so the hub stores them once within its duplicate window (10 min).

    intake = TaskIntake(bus, TaskIntakeConfig(hub_domain="hub", buffer_tasks=16))
    await intake.start(); await intake.run()      # until intake.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.bus.connection import Bus
from libs.bus.consumer import BUS_AWAY_LIMIT_S
from proto.regions import HUB_TASKS, REGION_WORKER_TASKS, api_prefix

log = structlog.get_logger(__name__)

TAKEN = Counter("rlpipe_region_tasks_taken_total", "Tasks taken from the hub's queue")
BUFFERED = Gauge("rlpipe_region_tasks_buffered", "Tasks in the region's queue or in progress")
LINK_UP = Gauge("rlpipe_region_hub_link_up", "1 while the hub's queue answers the region")
ACKS_LOST = Counter(
    "rlpipe_region_task_acks_lost_total", "Tasks stored in the region whose hub ack failed"
)


class TaskIntakeConfig(BaseModel):
    """Where a regional env-gateway takes its tasks from (its `intake` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hub_domain: str = Field(
        "",
        description="JetStream domain of the hub whose task queue this region takes from "
        "(deploy/nats/hub.conf: hub); empty: no intake (a gateway beside the hub)",
    )
    buffer_tasks: int = Field(
        16,
        ge=1,
        description="Tasks kept in the region's queue, waiting or in progress: what its "
        "workers roll out through a link outage",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often a full buffer or a down link is looked at again"
    )
    fetch_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait of one pull from the hub's queue"
    )

    @field_validator("hub_domain")
    @classmethod
    def _domain_valid(cls, value: str) -> str:
        if value:
            api_prefix(value)
        return value


class TaskIntake:
    """Tops the region's work queue up from the hub's, through the leaf link."""

    def __init__(self, bus: Bus, config: TaskIntakeConfig) -> None:
        assert config.hub_domain, "an intake needs the hub's domain"
        self.config = config
        self._region = bus.js
        self._hub: JetStreamContext = bus.nc.jetstream(domain=config.hub_domain)
        self._sub: JetStreamContext.PullSubscription | None = None
        self._stopping = asyncio.Event()
        self.num_taken = 0
        self.num_acks_lost = 0
        self.num_buffered = 0
        self.link_up: bool | None = None  # None until the hub's queue first answered or not

    async def start(self) -> None:
        """Bind the hub's shared consumer (no request crosses the link yet)."""
        self._sub = await self._hub.pull_subscribe_bind(
            durable=HUB_TASKS.durable, stream=HUB_TASKS.stream
        )

    async def run(self) -> None:
        """Take tasks until `stop`; the region's own server away for longer than
        BUS_AWAY_LIMIT_S (nats-py reconnecting meanwhile) ends it with the error."""
        failing_since: float | None = None
        wait_s = self.config.poll_interval_s
        try:
            while not self._stopping.is_set():
                try:
                    taken = await self.take_once()
                    failing_since = None
                except (nats.errors.Error, TimeoutError) as exc:
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since > BUS_AWAY_LIMIT_S:
                        raise
                    log.warning("the region's queue is not answering (set up by `rlpipe region "
                                "setup`)", error=repr(exc))  # fmt: skip
                    taken = 0
                if taken == 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), wait_s)
        finally:
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()

    async def buffered(self) -> int:
        """Tasks waiting in the region's queue plus tasks its workers hold."""
        info = await self._region.consumer_info(
            REGION_WORKER_TASKS.stream, REGION_WORKER_TASKS.durable
        )
        self.num_buffered = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        BUFFERED.set(self.num_buffered)
        return self.num_buffered

    async def take_once(self) -> int:
        """One round: pull up to the room left in the buffer, store, ack; tasks taken."""
        room = self.config.buffer_tasks - await self.buffered()
        if room <= 0:
            return 0
        taken = 0
        for msg in await self._fetch(room):
            try:
                await self._store(msg)
            except (nats.errors.Error, TimeoutError):
                # Not stored here: the hub hands it out again (the rest of the batch too,
                # after their ack wait).
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await msg.nak()
                raise
            await self._ack(msg)
            taken += 1
        self.num_taken += taken
        TAKEN.inc(taken)
        return taken

    async def _fetch(self, room: int) -> list[Msg]:
        assert self._sub is not None, "start() first"
        try:
            msgs = await self._sub.fetch(room, timeout=self.config.fetch_timeout_s)
        except ServiceUnavailableError:  # no hub behind the link: it is down
            self._link(False)
            return []
        except (nats.errors.TimeoutError, TimeoutError):  # the hub has no task for us now
            self._link(True)
            return []
        self._link(True)
        return msgs

    async def _store(self, msg: Msg) -> None:
        """The hub's message, as it is, in the region's queue (its message id kept)."""
        headers = dict(msg.headers or {})
        headers.setdefault("Nats-Msg-Id", f"hub-task-{msg.metadata.sequence.stream}")
        await self._region.publish(msg.subject, msg.data, headers=headers)

    async def _ack(self, msg: Msg) -> None:
        try:
            await msg.ack_sync(timeout=self.config.fetch_timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            self.num_acks_lost += 1
            ACKS_LOST.inc()
            log.warning("task stored in the region, its ack to the hub lost",
                        seq=msg.metadata.sequence.stream, error=repr(exc))  # fmt: skip

    def _link(self, up: bool) -> None:
        domain = self.config.hub_domain
        if up != self.link_up and up:
            log.info("the hub's task queue answers", hub_domain=domain)
        elif up != self.link_up:
            log.warning("no hub behind the link: the region rolls out its buffered tasks",
                        hub_domain=domain, buffered=self.num_buffered)  # fmt: skip
        self.link_up = up
        LINK_UP.set(1 if up else 0)
