"""The rollout-worker service: rolls out tasks with an inference engine and hot-swaps weights.

Lifecycle: `start` builds the engine and connects the pieces (libs/rollout); `run` follows
the weight announcements, reports "waiting for weights" until it holds the version that was
newest at start (or, on a fresh bus, the first one), and only then pulls tasks, up to
`max_batch_tasks` at a time, their generation merged into shared engine calls. Each task's
rollouts are published to `rl.rollouts.raw.<env>` with msg id = rollout id before the task
is acked, so a redelivered task stores nothing twice. A task tagged `min_policy_version`
(the synchronous baseline) waits in its handler for that version, at most
`min_version_wait_s`: then it is nak'd (retried later) and dead-lettered after the
consumer's attempts, so a version that never comes holds no slot forever. `stop` stops pulling,
lets in-flight tasks finish (drain_timeout_s), then ends the background loops.

Serve mode (`serve.port` set): the same engine also answers an OpenAI-compatible API
(libs.serve) on uvicorn in this loop; its requests go through the same batcher (batched with
rollouts, never across a weight swap) and every served choice is recorded on
`rl.serving.generations` before the answer. `consume_tasks=false` makes a replica that only
serves. The API answers 503 until the first weight version is applied; `stop` lets open
requests finish before the batcher ends.

Lending (`lending.enabled`, a serve replica that takes promoted versions only): the capacity
controller may lend the replica to RL and recall it (libs/fleet/lending.py): it leaves the
load balancer (/readyz answers 503), pulls tasks with the trainer's newest version, and comes
back to its promoted version, bit-exactly, when recalled.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

from libs.background_tasks import BackgroundTasks
from libs.bus.connection import Bus, connect_bus, redact_url
from libs.bus.consumer import Delivery, Handler, PermanentError, PullConsumer
from libs.bus.publisher import Outgoing, Publisher
from libs.chat.template import chat_template_for
from libs.engine.base import InferenceEngine
from libs.engine.factory import build_engine
from libs.engine.remote import RemoteEngine
from libs.envs.client import EnvClient, EnvError
from libs.fleet.lending import Lending
from libs.fleet.load_meter import LoadMeter, LoadMiddleware
from libs.fleet.loan import ReplicaParts
from libs.policy import architecture, load_policy_tokenizer, tokenizer_spec
from libs.policy_identity import check_same_policy, describe_policy, wait_for_identity
from libs.region.detect import on_regional_server, task_queue
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import GenerateFn
from libs.rollout.remote_versions import RemoteVersions
from libs.rollout.throughput import ThroughputMeter
from libs.rollout.weights_follower import WeightsFollower
from libs.serve.app import OpenAIApi, create_app
from libs.serve.generation import ServedPolicy
from libs.serve.records import GenerationRecorder
from libs.serve.server import ServeServer
from libs.service import Service
from libs.tokenizer import Tokenizer
from libs.weights.receiver import WeightReceiver
from libs.weights.relay import RegionalWeightReceiver
from libs.weights.same_host_link import SameHostTaker
from libs.weights.signing import policy_digest
from proto import messages as m
from proto.messages import PolicyIdentity, Task
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


class VersionWaitTimeout(Exception):
    """A task's min_policy_version did not arrive in time: its slot is given back."""


class RolloutWorkerService(Service):
    """Pulls tasks, rolls them out as GRPO groups, publishes raw rollouts; follows weights."""

    name = "rollout-worker"

    def __init__(self, settings: RolloutWorkerSettings) -> None:
        super().__init__()
        self.settings = settings
        self.engine: InferenceEngine | None = None
        self.batcher: GenerationBatcher | None = None
        self.follower: WeightsFollower | RemoteVersions | None = None
        self.receiver: WeightReceiver | None = None
        # The region's relay server when weights come from there (weights.nats_url).
        self.regional_bus: Bus | None = None
        # Connected to a region's own server (tasks, rollouts and weights stay there).
        self.regional = False
        self.runner: AgentRunner | None = None
        self.consumer: PullConsumer[Task] | None = None
        self.publisher: Publisher | None = None
        self.num_in_progress = 0
        self.num_waiting_for_version = 0
        self.num_published = 0
        self.served: ServedPolicy | None = None
        self.serve_api: ServeServer | None = None
        self.serve_openai: OpenAIApi | None = None
        self.identity: PolicyIdentity | None = None
        self.lending: Lending | None = None  # a serve replica the controller may lend
        self._stopping = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        s = self.settings
        self.engine = await asyncio.to_thread(build_engine, s.engine_config(), s.policy)
        tokenizer = load_policy_tokenizer(s.policy)
        self.identity = describe_policy(
            architecture(s.policy), self.engine.live_tensors(), tokenizer, tokenizer_spec(s.policy)
        )
        self.batcher = GenerationBatcher(
            self.engine,
            batch_window_s=s.batch_window_s,
            meter=ThroughputMeter(s.throughput_window_s),
            # A replica that rolls out keeps most of its engine for rollouts.
            served_share=s.serve.engine_share if s.consume_tasks else 1.0,
        )
        weights_bus = await self._weights_bus(bus)
        # On a region's own server (libs/region): the region's work queue and weight mirrors.
        self.regional = await on_regional_server(bus.js)
        # Deltas are decoded beside the engine in a process of its own where weights are on a GPU.
        on_gpu = any(t.is_cuda for t in (self.engine.live_tensors() or {}).values())
        self.receiver = self._receiver(weights_bus, on_gpu=on_gpu)
        self.follower = self._follower(bus)
        # Announcements from where the weights come from; the promoted version from the
        # trainer's KV state on the service connection.
        await self.follower.start(weights_bus.js, state_js=bus.js)
        generate: GenerateFn = self.batcher.generate
        if isinstance(self.follower, WeightsFollower):  # turns name versions by number and hash
            generate = self.follower.versions.stamped(generate)
        self.runner = AgentRunner(EnvClient(bus.nc), tokenizer, generate, s, self._agent_settings())
        self.publisher = Publisher(bus.js)
        self.consumer = self._task_consumer(self.on_task)
        if s.serve.port:
            await self._start_serving(bus, tokenizer)
        self.status = "waiting for weights"
        self.detail = f"worker {s.worker_id}: following weight announcements"

    async def run(self) -> None:
        try:
            async with BackgroundTasks(stop=self._stopping) as tasks:
                await self._work(tasks)
        finally:
            if self.receiver is not None:
                await self.receiver.close()
            if self.follower is not None and self.follower.same_host is not None:
                await self.follower.same_host.close()
            if self.regional_bus is not None:
                await self.regional_bus.close()

    async def _work(self, tasks: BackgroundTasks) -> None:
        """Catch up with the trainer's weights, then roll out tasks (or serve) until stopped;
        a background loop that dies takes the service down."""
        assert self.follower is not None and self.batcher is not None, "start() first"
        assert self.consumer is not None
        tasks.start("generation-batcher", self.batcher.run())
        for task in self._serving_tasks():  # the API server ends cleanly in `stop`
            tasks.adopt(task, may_end=True)
        if self.lending is not None:
            tasks.start("lending", self.lending.run())
        if not self.settings.follow_weights:
            self.follower.use_loaded_weights()
        else:
            # The trainer's policy must be ours before any of its weights are applied.
            await tasks.until(self._check_policy())
            tasks.start("weights-follower", self.follower.run())
            await tasks.until(self.follower.wait_caught_up())
        if self._stopping.is_set():
            return
        self.status = "ok"
        if not self.settings.consume_tasks:
            self.detail = f"worker {self.settings.worker_id}: serving only"
            log.info("caught up with weights; serving", version=self.engine_version)
            await tasks.until()
            return
        self.detail = f"worker {self.settings.worker_id}: rolling out tasks"
        log.info("caught up with weights; pulling tasks", version=self.engine_version)
        # The consumer returns once stopped; `stop` sets _stopping after the drain.
        tasks.start("task-consumer", self.consumer.run(), may_end=True)
        await tasks.until()

    async def _check_policy(self) -> None:
        """Wait for the trainer's PolicyIdentity; ValueError (the service stops with the
        reason) when it is not this worker's policy."""
        assert self.bus is not None and self.identity is not None
        self.detail = f"worker {self.settings.worker_id}: waiting for the trainer's policy"
        trainers = await wait_for_identity(self.bus.js)
        check_same_policy(self.identity, trainers)
        if self.receiver is not None:  # a version signed for another policy is refused
            self.receiver.verifier.expected_policy = policy_digest(trainers)
        self.detail = f"worker {self.settings.worker_id}: following weight announcements"

    async def stop(self) -> None:
        await super().stop()
        if self.lending is not None:  # a loan ends first: its tasks finish or are requeued
            await self.lending.stop()
        # Both drain while the batcher still runs; run() ends it once _stopping is set.
        await asyncio.gather(self._stop_serving(), self._stop_consuming())
        self._stopping.set()

    def _agent_settings(self) -> AgentSettings:
        """The harness limits, the context budget capped at what the engine can hold."""
        agent = self.settings
        limit = self.engine.max_context_tokens if self.engine is not None else None
        if limit is not None and agent.context_budget_tokens > limit:
            log.warning(
                "context budget capped at the model's positions",
                context_budget_tokens=agent.context_budget_tokens,
                max_context_tokens=limit,
            )
            return agent.model_copy(update={"context_budget_tokens": limit})
        return agent

    async def _weights_bus(self, bus: Bus) -> Bus:
        """The connection weights come over: the service's, or the region's relay server."""
        url = self.settings.weights.nats_url
        if not url:
            return bus
        name = f"{self.settings.worker_id}-weights"
        # The regional server's user comes with its URL; TLS as on the service connection.
        tls_only = replace(
            self.settings.nats_options(),
            user=None, password=None, nkey_seed_file=None, creds_file=None, inbox_prefix=None,
        )  # fmt: skip
        self.regional_bus = await connect_bus(url, name=name, options=tls_only)
        log.info("fetching weights from the regional relay", nats_url=redact_url(url))
        return self.regional_bus

    def _follower(self, bus: Bus) -> WeightsFollower | RemoteVersions:
        """What keeps the engine on the trainer's versions: the weights follower, or for a
        remote engine (the fleet holds the weights) the versions its requests require."""
        assert self.engine is not None and self.batcher is not None and self.receiver is not None
        if isinstance(self.engine, RemoteEngine):
            return RemoteVersions(self.engine, self.receiver.verifier, self.batcher)
        same_host = self._same_host_taker(bus)
        return WeightsFollower(self.engine, self.receiver, self.batcher, same_host=same_host)

    def _same_host_taker(self, bus: Bus) -> SameHostTaker | None:
        """Versions from the trainer's memory, where this engine's weights can be written in
        place (its live tensors are exposed) and it follows every version."""
        s = self.settings
        assert self.engine is not None, "the engine is built first"
        if not (s.same_host.enabled and s.follow_weights) or self.engine.live_tensors() is None:
            return None
        assert self.receiver is not None, "the receiver is built first"
        return SameHostTaker(bus, s.same_host, self.receiver.verifier)

    def _receiver(self, weights_bus: Bus, *, on_gpu: bool) -> WeightReceiver:
        config = self.settings.weights
        if not on_gpu:  # the decode process keeps a host copy for weights on a GPU only
            config = config.model_copy(update={"decode_process": False})
        if not self.settings.follow_weights:  # it applies nothing: no key needed
            config = config.model_copy(update={"allow_unsigned": True})
        if self.regional_bus is None and not self.regional:
            return WeightReceiver(weights_bus, config)
        # A mirror's announcement can arrive before its chunks: wait for them.
        return RegionalWeightReceiver(weights_bus, config)

    def _task_consumer(self, handler: Handler[Task]) -> PullConsumer[Task]:
        """The shared task consumer, around `handler` (a loan builds one of its own)."""
        assert self.bus is not None and self.publisher is not None, "start() first"
        s = self.settings
        return PullConsumer(
            self.bus.js,
            task_queue(self.regional),
            Task,
            handler,
            self.publisher,
            batch_size=s.max_batch_tasks,
            concurrency=s.max_batch_tasks,
            fetch_timeout_s=s.fetch_timeout_s,
        )

    async def _stop_consuming(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop(grace_s=self.settings.drain_timeout_s)

    # --- serve mode ------------------------------------------------------------------------

    async def _start_serving(self, bus: Bus, tokenizer: Tokenizer) -> None:
        """The OpenAI-compatible API over the batcher, recording to the generations stream."""
        assert self.batcher is not None and self.follower is not None
        s = self.settings
        recorder = None
        if s.record_generations:
            publisher = Publisher(  # bounded: the answer waits for the record
                bus.js,
                ack_timeout_s=s.record_timeout_s,
                max_attempts=s.record_attempts,
                retry_window_s=0.0,
            )
            recorder = GenerationRecorder(publisher)
        assert self.engine is not None
        self.served = ServedPolicy(
            self.batcher.generate_served,
            tokenizer,
            score=self.batcher.score,
            recorder=recorder,
            hold_tokens=s.serve.hold_tokens,
            max_context_tokens=self.engine.max_context_tokens,
        )
        follower = self.follower
        assert isinstance(follower, WeightsFollower), "serve mode runs a local engine"
        self.serve_openai = OpenAIApi(
            self.served,
            chat_template_for(tokenizer),
            self._product_version,
            s.serve,
            versions=follower.versions,
        )
        app = create_app(self.serve_openai)
        meter = LoadMeter(s.lending.load_window_s)
        if s.lending.enabled:
            app.add_middleware(LoadMiddleware, meter=meter)
        self.serve_api = ServeServer(
            app,
            s.serve.host,
            s.serve.port,
            graceful_s=s.drain_timeout_s,
            limits=s.serve.http_limits(),
            on_grace_over=self.serve_openai.stop_open,
        )
        await self.serve_api.start()
        if not s.record_generations:
            log.warning("serve mode records no generations: feedback on them cannot train")
        if s.lending.enabled:
            await self._start_lending(bus, meter)

    async def _start_lending(self, bus: Bus, meter: LoadMeter) -> None:
        """Take the capacity controller's lend and recall commands (libs/fleet)."""
        assert self.engine and self.batcher and self.receiver and self.serve_openai
        assert isinstance(self.follower, WeightsFollower), "a lent replica runs its engine"
        admission = self.serve_openai.admission
        parts = ReplicaParts(self.engine, self.batcher, self.follower, self.regional_bus or bus,
                             self.receiver.config, self._task_consumer, self.on_task)  # fmt: skip
        self.lending = Lending(self.settings.lending, self.settings.worker_id, parts, meter,
                               lambda: (admission.num_running, admission.num_queued))  # fmt: skip
        await self.lending.start(bus)

    def _product_version(self) -> int | None:
        """The version product requests are served with; None refuses them (503): no
        weights yet, or lent to RL."""
        if self.lending is not None and not self.lending.accepting:
            return None
        return self.follower.policy_version if self.follower is not None else None

    def ready(self) -> bool:
        """In the load balancer: healthy, and not lent."""
        return super().ready() and (self.lending is None or self.lending.ready)

    def _serving_tasks(self) -> list[asyncio.Task[None]]:
        """The API server's task, watched by run() like the other background loops."""
        task = self.serve_api.task if self.serve_api is not None else None
        return [task] if task is not None else []

    async def _stop_serving(self) -> None:
        """Stop accepting; open requests finish (their generations and records) first."""
        if self.serve_api is not None:
            await self.serve_api.stop()

    def _serve_health(self) -> dict[str, Any]:
        if self.serve_api is None or self.served is None or self.serve_openai is None:
            return {}
        recorder = self.served.recorder
        admission = self.serve_openai.admission
        return {
            "serve_port": self.serve_api.port,
            "serve_requests_running": admission.num_running,
            "serve_requests_queued": admission.num_queued,
            "serve_requests_in_engine": self.batcher.num_served_in_engine if self.batcher else 0,
            "generations_recorded": recorder.num_recorded if recorder else 0,
            "generation_records_lost": recorder.num_lost if recorder else 0,
        }

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
                rollouts = await self._roll_out(task)
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

    async def _roll_out(self, task: Task) -> list[m.Rollout]:
        """The task's rollouts; a remote engine's requests require its min_policy_version."""
        assert self.runner is not None
        if isinstance(self.follower, RemoteVersions):
            with self.follower.requiring(task.min_policy_version):
                return await self.runner.run(task)
        return await self.runner.run(task)

    async def _wait_for_version(self, task: Task) -> None:
        """Hold the task until the engine has weights of at least its min_policy_version."""
        follower = self.lending.version_follower if self.lending is not None else self.follower
        assert follower is not None
        if follower.has_version(task.min_policy_version):
            return
        self.num_waiting_for_version += 1
        TASKS_WAITING_FOR_VERSION.inc()
        log.info(
            "task waits for weights",
            task_id=task.task_id,
            min_policy_version=task.min_policy_version,
            held=self.engine_version,
        )
        wait_s = self.settings.min_version_wait_s
        try:
            async with asyncio.timeout(wait_s):
                await follower.wait_for_version(task.min_policy_version)
        except TimeoutError as exc:
            # Retried after a backoff (another worker, a later version); dead-lettered once
            # the consumer's attempts are spent.
            raise VersionWaitTimeout(
                f"task {task.task_id}: no weights of version >= {task.min_policy_version} "
                f"within {wait_s:.0f} s (holding {self.engine_version})"
            ) from exc
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
        problem = self.follower.problem() if self.follower is not None else None
        if problem is not None:
            report |= {"status": "failing", "detail": problem}
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
            **self._serve_health(),
            **(self.lending.health() if self.lending is not None else {}),
        }
