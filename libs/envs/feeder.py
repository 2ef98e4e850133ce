"""The task feeder: publishes an environment's tasks to the work queue.

Two modes:
- `async`: keep the rollout workers' queue (pending + in-progress tasks of the shared
  consumer proto.streams.ROLLOUT_WORKER_TASKS) at `queue_depth_tasks`, but never more than
  `max_ahead_versions` batches ahead of the trainer: at most
  groups taken by the trainer + (1 + max_ahead_versions) * batch_groups tasks published
  since the trainer's count began (KV keys `trainer_groups_taken` and `trainer_batch_groups`:
  the trainer's own batch size, so the two cannot disagree). That bounds staleness
  where it is made: a worker far ahead of the trainer would only produce samples the trainer
  drops (AReaL's rollout controller works the same way). Dropped groups count as taken, so
  drops free room instead of stalling the loop. With `min_ahead_versions` below
  `max_ahead_versions` the feeder paces how far ahead it runs, once per trainer step: one
  batch further while the trainer is about to wait (fewer than a batch of groups finished and
  not taken) and no task waits for a worker (the workers could take more: episodes waiting on
  slow tools); one batch less while a batch of tasks waits for a worker (more in flight
  would only age). So heavy-tailed episodes get the work in flight they need, and fast ones
  keep their samples fresh. Each task is tagged
  `min_policy_version = trainer's version - its staleness bound` (KV keys `policy_version`
  and `trainer_max_staleness`, 0 before the trainer wrote them): samples of older weights
  could only be dropped as stale, so a worker holding such weights waits for newer ones
  (rollout-worker `min_version_wait_s`) instead of generating them. Versions count updates
  unless the trainer resumed from a checkpoint (its number then jumps past the versions the
  crash lost), so after a resume the tag may ask for newer weights than needed, never older;
- `sync`: the synchronous baseline: each time the trainer's policy version (KV bucket
  proto.streams.STATE, key `policy_version`, an ASCII decimal integer) advances to v, publish
  exactly the trainer's `batch_groups` tasks tagged `min_policy_version=v`.
Before the trainer has written its batch size neither bounded mode publishes: the bound is
the trainer's, not a guess of it.
Each task's msg id is its task_id, and how far the feeder got is stored in the same bucket
(key `task_feeder.<env>`) after each publish, so a restarted feeder neither repeats nor skips.
Run one feeder per environment (other gateway replicas: feeder.mode=off).
A round runs every `poll_interval_s`, and at once when the trainer writes its progress
(`nc` given: core subscriptions to the KV subjects of its keys), so the next batch
of tasks leaves as soon as the trainer takes one instead of up to a poll interval later (on
one H200 a byte-0.5b step is ~0.23 s, the default poll 0.2 s).

    feeder = TaskFeeder(js, Publisher(js), source, env="arith", config=FeederConfig())
    await feeder.start(); await feeder.run()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Literal, Self

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, model_validator

from libs.bus.publisher import Outgoing, Publisher
from libs.envs.base import TaskSource
from proto import streams
from proto.messages import Task
from proto.subjects import task_subject

log = structlog.get_logger(__name__)

FeederMode = Literal["async", "sync", "off"]
MAX_FAILED_ROUNDS = 50

TASKS_PUBLISHED = Counter("rlpipe_feeder_tasks_published_total", "Tasks published", ["env"])
QUEUE_DEPTH = Gauge("rlpipe_feeder_queue_depth_tasks", "Tasks pending or in progress", ["env"])
AHEAD = Gauge("rlpipe_feeder_ahead_versions", "Trainer batches the feeder runs ahead", ["env"])


class FeederConfig(BaseModel):
    """How the feeder paces tasks (env-gateway's `feeder` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: FeederMode = Field(
        "async",
        description="async: keep the queue at queue_depth_tasks; sync: the trainer's "
        "batch_groups tasks per new policy version; off: serve episodes only",
    )
    queue_depth_tasks: int = Field(
        32, ge=1, description="Tasks kept pending or in progress (async mode)"
    )
    max_ahead_versions: int | None = Field(
        1,
        ge=0,
        description="async: trainer batches the feeder may run ahead of the trainer (bounds "
        "staleness); unset for no bound",
    )
    min_ahead_versions: int | None = Field(
        None,
        ge=0,
        description="async: below max_ahead_versions, the feeder paces how far ahead it runs "
        "between the two, once per trainer step (see libs/envs/feeder.py); unset: always max",
    )
    poll_interval_s: float = Field(
        0.2, gt=0, description="How often the feeder checks queue depth or policy version"
    )

    @model_validator(mode="after")
    def _ahead_limits(self) -> Self:
        low, high = self.min_ahead_versions, self.max_ahead_versions
        if low is not None and (high is None or low > high):
            raise ValueError(
                f"min_ahead_versions {low} needs a max_ahead_versions at least as high (got {high})"
            )
        return self


class FeederState(msgspec.Struct, kw_only=True):
    """How far the feeder got: stored in KV so a restart resumes."""

    next_index: int = 0
    fed_version: int = -1  # policy version of the last sync batch; -1 before the first


def feeder_state_key(env: str) -> str:
    return f"{streams.TASK_FEEDER_KEY_PREFIX}{env}"


async def read_policy_version(kv: KeyValue) -> int:
    """The trainer's current policy version; 0 before it has written one."""
    return await read_counter(kv, streams.POLICY_VERSION_KEY)


async def read_counter(kv: KeyValue, key: str) -> int:
    """A counter the trainer keeps in the state bucket; 0 before it has written one."""
    value = await read_optional_counter(kv, key)
    return 0 if value is None else value


async def read_optional_counter(kv: KeyValue, key: str) -> int | None:
    """A counter the trainer keeps in the state bucket; None before it has written one."""
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    try:
        return int((entry.value or b"0").decode())
    except ValueError:
        raise ValueError(
            f"KV {streams.STATE.bucket}/{key} holds {entry.value!r}; "
            "the trainer must write it as an ASCII decimal integer"
        ) from None


class TaskFeeder:
    """Publishes tasks from `source` to `task_subject(env)` in `mode`."""

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        source: TaskSource,
        *,
        env: str,
        config: FeederConfig,
        nc: NATS | None = None,
    ) -> None:
        self._js = js
        self._nc = nc
        self._publisher = publisher
        self._source = source
        self.env = env
        self.config = config
        self._start: tuple[int, int] | None = None  # (groups taken, tasks published) at start
        self.ahead = config.min_ahead_versions if config.min_ahead_versions is not None else None
        self._paced_at_taken: int | None = None  # groups taken at the last pacing decision
        self.state = FeederState()
        self.num_published = 0
        self._kv: KeyValue | None = None
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # stop asked, or the trainer's progress changed

    async def start(self) -> None:
        """Open the state bucket and resume from the stored position."""
        self._kv = await self._js.key_value(streams.STATE.bucket)
        try:
            entry = await self._kv.get(feeder_state_key(self.env))
            self.state = msgspec.json.decode(entry.value or b"{}", type=FeederState)
        except (KeyNotFoundError, KeyDeletedError):
            self.state = FeederState()
        log.info(
            "feeder ready", env=self.env, mode=self.config.mode, next_index=self.state.next_index
        )

    async def run(self) -> None:
        """Feed every `config.poll_interval_s` until `stop`; raise after `MAX_FAILED_ROUNDS` failed
        rounds in a row (a bus that stays unreachable), taking the service down loudly."""
        failures = 0
        progress = await self._hear_progress()
        try:
            while self.config.mode != "off" and not self._stopping.is_set():
                self._wake.clear()  # before the round: progress during it runs another
                try:
                    await self.feed_once()
                    failures = 0
                except Exception as exc:  # the bus restarting, a publish timing out: retry
                    failures += 1
                    log.warning(
                        "feeder round failed", env=self.env, failures=failures, error=repr(exc)
                    )
                    if failures >= MAX_FAILED_ROUNDS:
                        raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.config.poll_interval_s)
        finally:
            for subscription in progress:
                with contextlib.suppress(Exception):  # a closed connection has none left
                    await subscription.unsubscribe()

    async def _hear_progress(self) -> list[Subscription]:
        """Core subscriptions to the trainer's progress keys (version, groups taken, bound,
        batch size): a KV put is a publish on `$KV.<bucket>.<key>`, so they hear it as it
        is written, with no consumer to keep, and resubscribe with the client after a
        reconnect. A missed one costs a poll interval, nothing else."""
        if self._nc is None:
            return []

        async def nudge(_: object) -> None:
            self._wake.set()

        bucket = streams.STATE.bucket
        keys = (
            streams.POLICY_VERSION_KEY,
            streams.GROUPS_TAKEN_KEY,
            streams.MAX_STALENESS_KEY,
            streams.BATCH_GROUPS_KEY,
        )
        return [await self._nc.subscribe(f"$KV.{bucket}.{key}", cb=nudge) for key in keys]

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def feed_once(self) -> int:
        """One round of the mode's rule; returns the number of tasks published."""
        if self.config.mode == "async":
            return await self._top_up()
        if self.config.mode == "sync":
            return await self._feed_new_version()
        return 0

    async def queue_depth(self) -> int:
        """Tasks waiting for a worker plus tasks a worker holds unacked."""
        spec = streams.ROLLOUT_WORKER_TASKS
        info = await self._js.consumer_info(spec.stream, spec.durable)
        depth = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        QUEUE_DEPTH.labels(self.env).set(depth)
        return depth

    async def _top_up(self) -> int:
        room = min(
            self.config.queue_depth_tasks - await self.queue_depth(), await self._room_ahead()
        )
        if room <= 0:
            return 0
        return await self._publish(room, min_policy_version=await self._oldest_useful())

    async def _oldest_useful(self) -> int:
        """The oldest policy version whose samples the trainer can still train on now."""
        assert self._kv is not None, "call start() first"
        bound = await read_optional_counter(self._kv, streams.MAX_STALENESS_KEY)
        if bound is None:
            return 0
        return max(0, await read_policy_version(self._kv) - bound)

    async def _room_ahead(self) -> int:
        """Tasks that may still be published before the trainer's next version."""
        if self.config.max_ahead_versions is None:
            return self.config.queue_depth_tasks
        batch_groups = await self._trainer_batch_groups()
        if batch_groups is None:
            return 0
        assert self._kv is not None, "call start() first"
        taken = await read_counter(self._kv, streams.GROUPS_TAKEN_KEY)
        if self._start is None:
            self._start = (taken, self.num_published)
        taken_since_start = max(0, taken - self._start[0])
        in_flight = self.num_published - self._start[1]
        ahead = await self._paced_ahead(taken_since_start, in_flight, batch_groups)
        return taken_since_start + (1 + ahead) * batch_groups - in_flight

    async def _paced_ahead(self, taken: int, in_flight: int, batch_groups: int) -> int:
        """How many batches ahead to run: `max_ahead_versions`, or paced between the limits
        once per trainer step (the module docstring says how)."""
        limit = self.config.max_ahead_versions
        assert limit is not None
        if self.ahead is None:
            return limit
        if self._paced_at_taken is None:  # decisions come with the trainer's steps
            self._paced_at_taken = taken
        if taken < self._paced_at_taken + batch_groups:
            return self.ahead
        self._paced_at_taken = taken
        spec = streams.ROLLOUT_WORKER_TASKS
        info = await self._js.consumer_info(spec.stream, spec.durable)
        waiting, held = int(info.num_pending or 0), int(info.num_ack_pending or 0)
        finished_not_taken = in_flight - waiting - held - taken
        before, floor = self.ahead, self.config.min_ahead_versions or 0
        if waiting == 0 and finished_not_taken < batch_groups:
            self.ahead = min(self.ahead + 1, limit)
        elif waiting >= batch_groups:
            self.ahead = max(self.ahead - 1, floor)
        if self.ahead != before:
            log.info("feeder runs a different number of batches ahead", env=self.env,
                     ahead=self.ahead, was=before, waiting_for_a_worker=waiting,
                     finished_not_taken=finished_not_taken)  # fmt: skip
        AHEAD.labels(self.env).set(self.ahead)
        return self.ahead

    async def _trainer_batch_groups(self) -> int | None:
        """The trainer's groups per step; None before the trainer has written it."""
        assert self._kv is not None, "call start() first"
        return await read_optional_counter(self._kv, streams.BATCH_GROUPS_KEY)

    async def _feed_new_version(self) -> int:
        assert self._kv is not None, "call start() first"
        version = await read_policy_version(self._kv)
        batch_groups = await self._trainer_batch_groups()
        if version <= self.state.fed_version or batch_groups is None:
            return 0
        count = await self._publish(batch_groups, min_policy_version=version, fed=version)
        log.info("fed a sync batch", env=self.env, version=version, tasks=count)
        return count

    async def _publish(self, count: int, *, min_policy_version: int, fed: int | None = None) -> int:
        first = self.state.next_index
        now = time.time()
        tasks: list[Task] = [
            msgspec.structs.replace(
                self._source.task(index), min_policy_version=min_policy_version, created_at=now
            )
            for index in range(first, first + count)
        ]
        subject = task_subject(self.env)
        await self._publisher.publish_many(Outgoing(subject, t, msg_id=t.task_id) for t in tasks)
        # Stored after the publish: a crash in between republishes the same ids (deduplicated).
        self.state = FeederState(
            next_index=first + count,
            fed_version=self.state.fed_version if fed is None else fed,
        )
        await self._save_state()
        self.num_published += count
        TASKS_PUBLISHED.labels(self.env).inc(count)
        return count

    async def _save_state(self) -> None:
        assert self._kv is not None, "call start() first"
        await self._kv.put(feeder_state_key(self.env), msgspec.json.encode(self.state))
