"""The rollout-worker service: rolls out tasks with an inference engine and hot-swaps weights.

Lifecycle: `start` builds the engine and connects the pieces (libs/rollout); `run` follows
the weight announcements, reports "waiting for weights" until it holds the version that was
newest at start (or, on a fresh bus, the first one), and only then pulls tasks, up to
`max_batch_tasks` at a time, their generation merged into shared engine calls. Each task's
rollouts are published to `rl.rollouts.raw.<env>` with msg id = rollout id before the task
is acked, so a redelivered task stores nothing twice. A task tagged `min_policy_version`
(the synchronous baseline) waits in its handler for that version. `stop` stops pulling,
lets in-flight tasks finish (drain_timeout_s), then ends the background loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

from libs.bus.connection import Bus
from libs.bus.consumer import Delivery, PermanentError, PullConsumer
from libs.bus.publisher import Outgoing, Publisher
from libs.engine.base import InferenceEngine
from libs.engine.factory import build_engine
from libs.envs.client import EnvClient, EnvError
from libs.rollout.batcher import GenerationBatcher, ThroughputMeter
from libs.rollout.episode import RunnerSettings, SingleTurnRunner
from libs.rollout.weights_follower import WeightsFollower
from libs.service import Service
from libs.tokenizer import load_tokenizer
from libs.weights.receiver import WeightReceiver
from proto import messages as m
from proto.messages import Task
from proto.streams import ROLLOUT_WORKER_TASKS
from proto.subjects import rollout_raw_subject
from services.rollout_worker.settings import RolloutWorkerSettings

log = structlog.get_logger(__name__)

ROLLOUTS_PUBLISHED = Counter(
    "rlpipe_rollout_rollouts_published_total", "Rollouts stored on the raw stream", ["env"]
)
TASKS_IN_PROGRESS = Gauge("rlpipe_rollout_tasks_in_progress", "Tasks being rolled out now")
TASKS_WAITING_FOR_VERSION = Gauge(
    "rlpipe_rollout_tasks_waiting_for_version", "Tasks held until their min_policy_version"
)

# Reset errors after which the same task can never start: reject it (dead letter).
PERMANENT_ENV_ERRORS = frozenset({m.ENV_ERROR_BAD_REQUEST})


class RolloutWorkerService(Service):
    """Pulls tasks, rolls them out as GRPO groups, publishes raw rollouts; follows weights."""

    name = "rollout-worker"

    def __init__(self, settings: RolloutWorkerSettings) -> None:
        super().__init__()
        self.settings = settings
        self.engine: InferenceEngine | None = None
        self.batcher: GenerationBatcher | None = None
        self.follower: WeightsFollower | None = None
        self.receiver: WeightReceiver | None = None
        self.runner: SingleTurnRunner | None = None
        self.consumer: PullConsumer[Task] | None = None
        self.publisher: Publisher | None = None
        self.num_in_progress = 0
        self.num_waiting_for_version = 0
        self.num_published = 0
        self._stopping = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        s = self.settings
        config = s.engine_config()
        self.engine = await asyncio.to_thread(build_engine, config)
        tokenizer = load_tokenizer(config.tokenizer)
        self.batcher = GenerationBatcher(
            self.engine,
            max_batch_tasks=s.max_batch_tasks,
            batch_window_s=s.batch_window_s,
            meter=ThroughputMeter(s.throughput_window_s),
        )
        self.receiver = WeightReceiver(
            bus,
            parallel=s.weights_fetch_parallel,
            fetch_timeout_s=s.weights_fetch_timeout_s,
            verify_full=s.weights_verify_full,
        )
        self.follower = WeightsFollower(self.engine, self.receiver, self.batcher)
        await self.follower.start(bus.js)
        runner_settings = RunnerSettings(
            worker_id=s.worker_id,
            temperature=s.temperature,
            top_p=s.top_p,
            reset_timeout_s=s.env_reset_timeout_s,
            step_timeout_s=s.env_step_timeout_s,
        )
        self.runner = SingleTurnRunner(
            EnvClient(bus.nc), tokenizer, self.batcher.generate, runner_settings
        )
        self.publisher = Publisher(bus.js)
        self.consumer = PullConsumer(
            bus.js,
            ROLLOUT_WORKER_TASKS,
            Task,
            self.on_task,
            self.publisher,
            batch_size=s.max_batch_tasks,
            concurrency=s.max_batch_tasks,
            fetch_timeout_s=s.fetch_timeout_s,
        )
        self.status = "waiting for weights"
        self.detail = f"worker {s.worker_id}: following weight announcements"

    async def run(self) -> None:
        assert self.follower is not None and self.batcher is not None, "start() first"
        assert self.consumer is not None
        background = [
            asyncio.create_task(self.follower.run(), name="weights-follower"),
            asyncio.create_task(self.batcher.run(), name="generation-batcher"),
        ]
        try:
            await self._until(self.follower.wait_caught_up(), background)
            if self._stopping.is_set():
                return
            self.status = "ok"
            self.detail = f"worker {self.settings.worker_id}: rolling out tasks"
            log.info("caught up with weights; pulling tasks", version=self.engine_version)
            background.append(asyncio.create_task(self.consumer.run(), name="task-consumer"))
            # The consumer returns once stopped; `stop` sets _stopping after the drain.
            await self._until(self._stopping.wait(), background, finished_ok={"task-consumer"})
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self.receiver is not None:
                await self.receiver.close()

    async def _until(
        self,
        goal: Coroutine[Any, Any, Any],
        background: list[asyncio.Task[None]],
        finished_ok: set[str] | None = None,
    ) -> None:
        """Wait for `goal` or for stop; a background task that ends (unless its name is in
        `finished_ok` and it ended cleanly) takes the service down loudly."""
        waiting = {asyncio.ensure_future(goal), asyncio.ensure_future(self._stopping.wait())}
        pending = set(background)
        try:
            while True:
                done, _ = await asyncio.wait(waiting | pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done & pending:
                    pending.discard(task)
                    error = task.exception()
                    if error is not None or task.get_name() not in (finished_ok or set()):
                        raise RuntimeError(f"{task.get_name()} stopped unexpectedly") from error
                if done & waiting:
                    return
        finally:
            for task in waiting:
                task.cancel()

    async def stop(self) -> None:
        await super().stop()
        if self.consumer is not None:
            await self.consumer.stop(grace_s=self.settings.drain_timeout_s)
        self._stopping.set()

    async def on_task(self, task: Task, delivery: Delivery) -> None:
        """Roll `task` out and store its rollouts; returning lets the consumer ack it."""
        assert self.runner is not None and self.publisher is not None
        assert self.follower is not None
        try:
            subject = rollout_raw_subject(task.env)
        except ValueError as exc:
            raise PermanentError(f"task {task.task_id}: {exc}") from exc
        if task.group_size < 1:
            raise PermanentError(f"task {task.task_id}: group_size {task.group_size} < 1")
        self.num_in_progress += 1
        TASKS_IN_PROGRESS.inc()
        try:
            await self._wait_for_version(task)
            try:
                rollouts = await self.runner.run(task)
            except EnvError as exc:
                if exc.kind in PERMANENT_ENV_ERRORS:
                    raise PermanentError(f"task {task.task_id}: env refused it: {exc}") from exc
                raise
            acks = await self.publisher.publish_many(
                Outgoing(subject, rollout, rollout.rollout_id) for rollout in rollouts
            )
        finally:
            self.num_in_progress -= 1
            TASKS_IN_PROGRESS.dec()
        stored = sum(1 for ack in acks if not ack.duplicate)
        self.num_published += stored
        ROLLOUTS_PUBLISHED.labels(task.env).inc(stored)

    async def _wait_for_version(self, task: Task) -> None:
        """Hold the task until the engine has weights of at least its min_policy_version."""
        assert self.follower is not None
        if self.follower.has_version(task.min_policy_version):
            return
        self.num_waiting_for_version += 1
        TASKS_WAITING_FOR_VERSION.inc()
        log.info(
            "task waits for weights",
            task_id=task.task_id,
            min_policy_version=task.min_policy_version,
            held=self.engine_version,
        )
        try:
            await self.follower.wait_for_version(task.min_policy_version)
        finally:
            self.num_waiting_for_version -= 1
            TASKS_WAITING_FOR_VERSION.dec()

    @property
    def engine_version(self) -> int | None:
        """Policy version the engine generates with; None before the first swap."""
        return self.follower.policy_version if self.follower else None

    def health(self) -> dict[str, Any]:
        report = super().health()
        if self.follower is not None and not self.follower.usable and self.status == "ok":
            report["status"] = "waiting for weights"
        meter = self.batcher.meter if self.batcher else None
        pause = self.follower.last_pause_s if self.follower else None
        return {
            **report,
            "worker_id": self.settings.worker_id,
            "policy_version": self.engine_version,
            "tasks_in_progress": self.num_in_progress,
            "tasks_waiting_for_version": self.num_waiting_for_version,
            "rollouts_published": self.num_published,
            "tokens_per_s": round(meter.tokens_per_s(), 2) if meter else 0.0,
            "busy_fraction": round(meter.busy_fraction(), 4) if meter else 0.0,
            "last_swap_pause_s": None if pause is None else round(pause, 6),
            "weight_swaps": self.follower.num_applied if self.follower else 0,
            "weight_swap_failures": self.follower.num_failed if self.follower else 0,
        }
