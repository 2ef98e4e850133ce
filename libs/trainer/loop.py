"""The trainer's loop: collect samples, drop stale ones, step, publish, gate the new version.

    setup   resume from the latest checkpoint (or build the policy), announce its weights;
            the eval gate resumes from its last decision (or decides on these weights)
    run     repeat: stream <- offline or online, by the step schedule (libs.trainer.mix)
                    offline: batch <- complete groups from the scored stream
                             kept, dropped <- staleness split against the trainer's version
                             stats <- train_step(kept)             (in a worker thread)
                    online:  taken <- fresh online samples (stale, invalid ones dropped)
                             stats <- train_online_step(taken)     (in a worker thread)
                    version += 1; stage the new weights for the broadcaster
                    record the step; eval gate every N versions; checkpoint every N steps
    stop    finish the current step, checkpoint, return

Exactly-once: the scored and online streams are read from the checkpoint's cursors; a sample
is marked consumed when its step (or its drop) is recorded, and the cursor is saved with the model.
A sample copied twice on the stream is consumed once: the groups taken lately are remembered
(and checkpointed), and a later copy is dead-lettered as a duplicate.

No sample can stop the loop: what the stream reader cannot decode or validate, what the trainer
refuses as it reads (token ids outside the vocabulary, versions it never made, nothing to
train: libs.trainer.refusals), duplicates, and the samples that make an optimizer step fail on
their own are dead-lettered with the reason and consumed; the step trains the rest. Only a
failure no sample reproduces (the trainer's own bug) ends the process.
After a crash, everything the last checkpoint had not consumed is read again, and nothing
it had is. Versions never repeat: a resumed trainer publishes its checkpoint's weights as a
version above every version announced before (read from the KV bucket), so workers roll
back to the checkpoint's weights under a new number; staleness then counts updates between
the sample's weights and the trainer's, not numbers (libs.trainer.lineage), so the samples
of the steps lost with a crash are not all dropped as stale.

Under torchrun this loop is rank 0 of the sharded trainer (libs.trainer.ranks.ShardedTrainer):
the hooks that touch the model (`_build_model`, `_load`, the step, `_published_state`,
`_model_for_eval`, `_write_tensors`) run on every rank; everything else runs here alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
import structlog
import torch
from nats.js.errors import KeyNotFoundError
from transformers import PreTrainedModel

from libs.bus.connection import Bus, ride_through
from libs.bus.publisher import Publisher
from libs.bus.stream_reader import StreamReader, StreamRecord
from libs.envs.client import EnvClient
from libs.logs import bind_context
from libs.policy import check_vocabulary, load_policy_tokenizer, tokenizer_spec
from libs.policy_identity import describe_policy, store_identity
from libs.rl import (
    MismatchStats,
    PolicyLossStats,
    split_by_staleness,
    staleness_histogram,
    turn_trainable,
)
from libs.rollout.figures import is_success
from libs.trainer.checkpoint import (
    TrainerState,
    host_snapshot_writer,
    latest_checkpoint,
    load_optimizer_state,
    write_checkpoint,
    write_model_and_optimizer,
)
from libs.trainer.config import TrainerConfig
from libs.trainer.eval_gate import EvalGate
from libs.trainer.groups import Group, GroupBuffer
from libs.trainer.host_memory import HostCopy
from libs.trainer.metrics import StepRecord, StepSamples, open_step_log
from libs.trainer.mix import Stream, choose_stream, scheduled_stream
from libs.trainer.online_source import OnlineSource, OnlineTake
from libs.trainer.online_step import OnlineStepStats, train_online_step
from libs.trainer.precision import TrainingPrecision
from libs.trainer.reference import setup_reference
from libs.trainer.refusals import (
    find_failing_samples,
    model_vocab_size,
    online_problem,
    scored_problem,
)
from libs.trainer.staging import WeightStager
from libs.trainer.step import StepStats, train_step
from libs.weights.encoder import EncodeOptions, chunk_bytes_for
from libs.weights.handoff import default_staging_dir
from libs.weights.receiver import latest_announcement
from proto import streams, subjects
from proto.messages import OnlineSample, ScoredRollout

log = structlog.get_logger(__name__)

T = TypeVar("T")


# Scored or online messages read from the stream at once.
READ_BATCH = 256


@dataclass(frozen=True)
class RunPaths:
    """Where a trainer keeps its state under the run folder."""

    run_dir: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "trainer" / "checkpoints"

    @property
    def staging_dir(self) -> Path:
        return default_staging_dir(self.run_dir)


def learning_rate_at(config: TrainerConfig, step: int) -> float:
    """The learning rate of step `step` (0-based), from the step alone so a resume agrees."""
    if config.learning_rate is None:
        raise ValueError("the learning rate is unset: resolve it with TrainerConfig.sized_for")
    if config.learning_rate_decay_steps is None:
        return config.learning_rate
    progress = min(step / config.learning_rate_decay_steps, 1.0)
    return config.learning_rate * (1.0 - (1.0 - config.min_learning_rate_ratio) * progress)


@dataclass
class Batch:
    """Groups taken for one step, split by staleness."""

    groups: list[Group]
    kept: list[ScoredRollout]
    dropped: list[ScoredRollout]
    staleness: dict[int, int]
    wait_s: float
    # Of wait_s, the time samples were ready but held back until the trainer's weights
    # reached the workers (_weights_announced).
    weights_wait_s: float = 0.0
    # Samples dead-lettered because the step failed on them alone.
    refused: list[ScoredRollout] = field(default_factory=list)

    @property
    def sequences(self) -> list[int]:
        return [seq for group in self.groups for seq in group.sequences]


@dataclass
class Timers:
    started_s: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(time.monotonic() - self.started_s, 1e-9)


class Trainer:
    """Owns the policy, the optimizer and the trainer's position in the scored stream."""

    # Checkpoints are written beside training (config.checkpoint_in_background) but by the
    # sharded trainer, whose save is a collective of every rank.
    background_checkpoints = True

    def __init__(
        self, config: TrainerConfig, run_dir: Path, bus: Bus, publisher: Publisher
    ) -> None:
        self.config = config
        # The tokenizer is resolved once: a checkpoint folder resumed from keeps using it.
        self.policy = config.policy.model_copy(update={"tokenizer": tokenizer_spec(config.policy)})
        self.paths = RunPaths(run_dir)
        self._bus = bus
        self._publisher = publisher
        self._stopping = asyncio.Event()
        self._buffer = GroupBuffer(config.incomplete_group_timeout_s)
        self._timers = Timers()
        self.state = TrainerState(step=0, version=0)
        self.tokenizer = load_policy_tokenizer(self.policy)
        self.precision = TrainingPrecision.for_policy(config.master_weights, self.policy)
        self.model = self._build_model()
        check_vocabulary(self.model, self.tokenizer, self.policy)
        num_parameters = sum(p.numel() for p in self.model.parameters())
        self.config = config = config.sized_for(num_parameters)
        self._steps = open_step_log(config, run_dir)  # the resolved config as run parameters
        self._stager = WeightStager(
            publisher, self.paths.staging_dir, deltas=self._hands_over_deltas(),
            options=EncodeOptions(
                max_chunk_bytes=chunk_bytes_for(bus.nc.max_payload),
                threads=config.handover_threads,
            ),
        )  # fmt: skip
        self._checkpoint_write: asyncio.Task[None] | None = None
        self._host_copy = HostCopy()
        self._checkpointed_step: int | None = None  # the step of the last checkpoint written
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate_at(config, 0),
            weight_decay=config.weight_decay,
        )
        # The configured policy, never a checkpoint: a resumed run keeps its anchor.
        self._reference = setup_reference(config.kl_coef, self.policy)
        self._reader: StreamReader[ScoredRollout] | None = None
        self._online: OnlineSource | None = None
        self._gate = EvalGate(config.eval, self.policy, self.tokenizer, EnvClient(bus.nc))
        self.status = "starting"
        self.detail = ""

    def _hands_over_deltas(self) -> bool:
        """Whether the stager encodes deltas itself (config.weight_handover)."""
        if self.config.weight_handover == "auto":
            return any(p.is_cuda for p in self.model.parameters())
        return self.config.weight_handover == "delta"

    def _build_model(self) -> PreTrainedModel:
        """The policy trained, in the master dtype (the sharded trainer shards it)."""
        return self.precision.build_model(self.policy)

    async def setup(self) -> None:
        """Resume from the latest checkpoint if any, then publish the weights we hold."""
        checkpoint = latest_checkpoint(self.paths.checkpoint_dir)
        if checkpoint is not None:
            await asyncio.to_thread(self._load, checkpoint.path, checkpoint.state)
            self.state.segment += 1
            self._buffer = GroupBuffer(
                self.config.incomplete_group_timeout_s, taken=self.state.recent_groups
            )
            log.info("resumed", step=self.state.step, checkpoint=str(checkpoint.path))
        identity = describe_policy(
            self.model.config,
            self.model.state_dict(),
            self.tokenizer,
            tokenizer_spec(self.policy),
        )
        await store_identity(self._bus.js, identity)
        announced = await self._announced_version()
        if announced is not None:
            # Versions never repeat: these weights go out under a number above any seen.
            resumed_from = self.state.version
            self.state.version = max(self.state.version, announced) + 1
            if checkpoint is not None:
                self.state.lineage = self.state.lineage.resumed(resumed_from, self.state.version)
        await self._publish_weights()
        await self._stager.flush()  # workers start from these weights: staged before any step
        self._reader = StreamReader(
            self._bus.js,
            streams.ROLLOUTS_SCORED.name,
            subjects.ROLLOUTS_SCORED,
            ScoredRollout,
            self._publisher,
            start_sequence=self.state.scored_cursor.floor + 1,
            reader_name="trainer",
        )
        if self.config.online.fraction > 0:
            self._online = self._setup_online_source()
        await self._setup_gate()
        self.status = "ok"

    def _setup_online_source(self) -> OnlineSource:
        reader = StreamReader(
            self._bus.js,
            streams.ROLLOUTS_ONLINE.name,
            subjects.ROLLOUTS_ONLINE,
            OnlineSample,
            self._publisher,
            start_sequence=self.state.online_cursor.floor + 1,
            reader_name="trainer-online",
        )
        return OnlineSource(
            reader, self.state.online_cursor, self._online_problem, self.state.lineage.equivalent
        )

    async def _setup_gate(self) -> None:
        """Resume the gate; with nothing promoted yet, the weights we start from are judged."""
        await self._gate.setup(self._bus.js)
        if self._gate.config.enabled and self._gate.last is None:
            await self._decide()

    def _load(self, path: Path, state: TrainerState) -> None:
        self.model = self.precision.build_model(self.policy.model_copy(update={"path": str(path)}))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate_at(self.config, self.state.step),
            weight_decay=self.config.weight_decay,
        )
        device = next(self.model.parameters()).device
        self.optimizer.load_state_dict(load_optimizer_state(path, device))
        self.state = state
        self._checkpointed_step = state.step

    async def run(self) -> None:
        """Train until stopped or `max_steps` is reached; checkpoint on the way out."""
        self._timers = Timers()
        try:
            while not self._stopping.is_set() and not self._reached_max_steps():
                stream = await self._choose_stream()
                if stream == "online":
                    await self._train_online(self._take_online())
                    continue
                batch = await self._next_batch() if stream == "offline" else None
                if batch is None:
                    break
                await self._train(batch)
        finally:
            await self._finish()

    async def _finish(self) -> None:
        """Flush (and close) the stager, make sure the last step has a checkpoint (once: not
        again when its own was just written; in line when the background write failed), close
        the readers and the step records. Each part runs whatever the ones before did, so a
        failed write loses neither the final checkpoint nor the records; the first failure
        is raised after all of them."""
        failures: list[Exception] = []

        async def attempt(part: Awaitable[object], what: str) -> None:
            try:
                await part
            except Exception as exc:  # raised below, after the rest of the cleanup
                log.error("trainer stop failed", part=what, error=repr(exc))
                failures.append(exc)

        await attempt(self._stager.close(), "stage the last version")
        await attempt(self._checkpoint_written(), "background checkpoint")
        if self.state.step > 0 and self._checkpointed_step != self.state.step:
            await attempt(asyncio.to_thread(self._checkpoint), "final checkpoint")
        if self._reader is not None:
            await attempt(self._reader.close(), "close the scored reader")
        if self._online is not None:
            await attempt(self._online.close(), "close the online reader")
        self._steps.close()
        if failures:
            raise failures[0]

    async def stop(self) -> None:
        self._stopping.set()

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    async def _next_batch(self) -> Batch | None:
        """Take groups until `batch_groups` of them have samples fresh enough to train on.

        Stale samples are dropped as their groups are taken, so a step always trains on a
        full batch; the dropped ones are reported with it. None when stopping first.
        """
        started_s = time.monotonic()
        self.detail = "" if self.state.step else "waiting for the first rollouts"
        taken: list[Group] = []
        kept: list[ScoredRollout] = []
        dropped: list[ScoredRollout] = []
        staleness: list[int] = []
        num_fresh_groups = 0
        weights_wait_s = 0.0
        while num_fresh_groups < self.config.batch_groups:
            waited_s = await self._fill_buffer()
            if waited_s is None:
                self._buffer.put_back(taken)  # not consumed: read again after a resume
                self.state.groups_taken -= len(taken)
                return None
            weights_wait_s += waited_s
            groups = self._buffer.take(self.config.batch_groups - num_fresh_groups)
            fresh_before = num_fresh_groups
            for group in groups:
                split = split_by_staleness(
                    group.rollouts,
                    self.state.version,
                    self._max_staleness,
                    self.state.lineage.equivalent,
                )
                taken.append(group)
                kept += split.kept
                dropped += split.dropped
                staleness += split.staleness
                num_fresh_groups += bool(split.kept)
            self.state.groups_taken += len(groups)
            if num_fresh_groups - fresh_before < len(groups):
                # Dropped groups free the feeder's room now, or a loop whose samples all
                # went stale would wait for tasks the feeder holds back for it.
                await self._record_progress()
        return Batch(
            groups=taken,
            kept=kept,
            dropped=dropped,
            staleness=staleness_histogram(staleness),
            wait_s=time.monotonic() - started_s,
            weights_wait_s=weights_wait_s,
        )

    async def _fill_buffer(self) -> float | None:
        """Read until at least one group is ready and the workers can have weights fresh
        enough to train on; returns the seconds spent holding ready groups back for the
        weights, None when stopping first."""
        weights_wait_s = 0.0
        while True:
            # A version that failed to stage never reaches the workers, whose samples may
            # wait for it: stop loudly (and be restarted) rather than wait forever.
            self._stager.raise_if_failed()
            ready = self._buffer.num_ready > 0
            if ready and await self._weights_announced():
                return weights_wait_s
            if self._stopping.is_set():
                return None
            started_s = time.monotonic()
            await self._poll_scored(timeout_s=0.5)
            if ready:
                weights_wait_s += time.monotonic() - started_s

    async def _weights_announced(self) -> bool:
        """False while the newest announced version is so far behind the trainer's that
        every sample generated now would be dropped as stale (the weight-broadcaster is down
        or behind): taking groups then would only drop them and let the feeder hand the
        workers more tasks to waste. True when nothing was announced yet (no broadcaster)."""
        try:
            found = [await latest_announcement(self._bus.js, k) for k in ("delta", "snapshot")]
        except (nats.errors.Error, TimeoutError) as exc:  # the bus is away: reads wait anyway
            log.warning("cannot read the announced version", error=repr(exc))
            return True
        versions = [announcement.version for _, announcement in filter(None, found)]
        if not versions:
            return True
        # One version short of max_staleness: samples of the newest announced version in
        # the buffer and in flight stay trainable until the broadcaster is back.
        lag = self.state.version - max(versions)
        allowed = max(self._max_staleness - 1, self.config.publish_every_steps - 1, 0)
        if lag > allowed:
            self.detail = f"waiting for version {self.state.version} to reach the workers"
            return False
        return True

    async def _poll_scored(self, timeout_s: float) -> None:
        """Buffer what the scored stream has (waits up to `timeout_s` when it has nothing);
        what the reader dead-lettered, and what is refused here, is consumed at once."""
        assert self._reader is not None, "setup() first"
        read = await self._reader.read(READ_BATCH, timeout_s=timeout_s)
        cursor = self.state.scored_cursor
        cursor.mark_done(read.skipped)
        for record in read.records:
            if cursor.is_done(record.sequence):
                continue
            problem = scored_problem(
                record.message,
                vocab_size=model_vocab_size(self.model),
                trainer_version=self.state.version,
            )
            if problem is not None:
                await self._refuse(record, problem)
                self._buffer.refuse(record.message)
            elif self._buffer.add(record.sequence, record.message) == "duplicate":
                await self._refuse(record, "duplicate of a sample already taken", "rejected")
        self._buffer.expire()

    async def _refuse(
        self, record: StreamRecord[ScoredRollout], error: str, reason: str = "invalid"
    ) -> None:
        """Dead-letter a scored sample and count it consumed."""
        assert self._reader is not None, "setup() first"
        await self._reader.refuse(record, error, reason)
        self.state.scored_cursor.mark_done([record.sequence])

    def _online_problem(self, sample: OnlineSample) -> str | None:
        return online_problem(
            sample, vocab_size=model_vocab_size(self.model), trainer_version=self.state.version
        )

    async def _choose_stream(self) -> Stream | None:
        """The stream this step trains on (libs.trainer.mix); None when stopping first."""
        fraction = self.config.online.fraction
        if self._online is None:
            return "offline"  # online training off: _next_batch waits for groups itself
        scheduled = scheduled_stream(self.state.step, fraction)
        started_s = time.monotonic()
        while not self._stopping.is_set():
            choice = choose_stream(
                scheduled,
                offline_ready=self._buffer.num_ready > 0,
                online_fresh=self._online.num_fresh(
                    self.state.version, self.config.online.max_staleness
                ),
                online_batch_samples=self.config.online.batch_samples,
                online_fraction=fraction,
                waited_s=time.monotonic() - started_s,
                stream_wait_s=self.config.online.stream_wait_s,
            )
            if choice is not None:
                return choice
            if fraction < 1.0:
                await self._poll_scored(timeout_s=0.25)
            await self._online.poll(READ_BATCH, timeout_s=0.25)
        return None

    def _take_online(self) -> OnlineTake:
        assert self._online is not None, "online training is off"
        online = self.config.online
        return self._online.take(online.batch_samples, self.state.version, online.max_staleness)

    async def _train(self, batch: Batch) -> None:
        self._set_learning_rate()
        started_s = time.monotonic()
        stats = await self._train_step_isolating(batch)
        if stats is None:  # every fresh sample was refused: consumed, no step
            self.state.scored_cursor.mark_done(batch.sequences)
            await self._record_progress()
            return
        step_s = self._advance(started_s)
        self.state.scored_cursor.mark_done(batch.sequences)
        self._steps.write(*self._record(batch, stats, step_s))
        await self._after_step()

    async def _train_step_isolating(self, batch: Batch) -> StepStats | None:
        """train_step on the batch; when it fails, dead-letter the samples that fail alone
        and train the rest (None when none is left). Raises when no sample is to blame."""
        while batch.kept:
            try:
                return await asyncio.to_thread(
                    self._computing,
                    train_step,
                    self.model,
                    self.optimizer,
                    batch.kept,
                    self.state.version,
                    self.config,
                    self.tokenizer.pad_id,
                    self._reference,
                    turn_trainable(
                        self.state.version,
                        self._max_staleness,
                        self.state.lineage.equivalent,
                    ),
                )
            except Exception as exc:
                failing = await asyncio.to_thread(
                    self._computing,
                    find_failing_samples,
                    self.model,
                    batch.kept,
                    pad_id=self.tokenizer.pad_id,
                    max_length=self.config.max_sequence_tokens,
                )
                if not failing or (len(failing) == len(batch.kept) > 1):
                    raise  # not one sample's fault: the trainer's own bug
                log.error("step failed on samples; dead-lettering them", error=repr(exc))
                await self._refuse_failing(batch, failing)
        return None

    async def _refuse_failing(self, batch: Batch, failing: list[tuple[ScoredRollout, str]]) -> None:
        sequence_of = {
            sample.rollout.rollout_id: seq
            for g in batch.groups
            for seq, sample in g.samples.values()
        }
        for sample, why in failing:
            record = StreamRecord(sequence_of[sample.rollout.rollout_id], sample)
            await self._refuse(record, f"the optimizer step failed on this sample: {why}")
        bad = {id(sample) for sample, _ in failing}
        batch.refused += [sample for sample in batch.kept if id(sample) in bad]
        batch.kept = [sample for sample in batch.kept if id(sample) not in bad]

    async def _train_online(self, taken: OnlineTake) -> None:
        assert taken.kept, "an online step is chosen only with fresh samples"
        self._set_learning_rate(scale=self.config.online.learning_rate_scale)
        started_s = time.monotonic()
        stats = await asyncio.to_thread(
            self._computing,
            train_online_step,
            self.model,
            self.optimizer,
            taken.kept,
            self.state.online_baselines,
            self.state.version,
            self.config,
            self.config.online,
            self.tokenizer.pad_id,
        )
        step_s = self._advance(started_s)
        self.state.online_cursor.mark_done(taken.sequences)
        self._steps.write(*self._online_record(taken, stats, step_s))
        await self._after_step()

    @property
    def _max_staleness(self) -> int:
        assert self.config.max_staleness is not None, "set by sized_for in __init__"
        return self.config.max_staleness

    def _computing(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`function` in the trainer's compute precision (call it in the worker thread:
        autocast state is per thread)."""
        with self.precision.compute():
            return function(*args, **kwargs)

    def _set_learning_rate(self, scale: float = 1.0) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = scale * learning_rate_at(self.config, self.state.step)

    def _advance(self, started_s: float) -> float:
        """Count the step and the new version; returns the step's seconds."""
        step_s = time.monotonic() - started_s
        self._timers.busy_s += step_s
        self.state.step += 1
        self.state.version += 1
        bind_context(step=self.state.step, policy_version=self.state.version)
        return step_s

    async def _after_step(self) -> None:
        """Publish (or record progress), gate a published version when due, checkpoint."""
        published = self.state.step % self.config.publish_every_steps == 0
        if published:
            await self._publish_weights()
        else:
            await self._record_progress()
        if published and self._gate.due(self.state.version):
            await self._decide()
        kept = self._keeps_version()  # first: it also notes the best held-out score
        if kept or self.state.step % self.config.checkpoint_every_steps == 0:
            await self._save_checkpoint()

    async def _decide(self) -> None:
        """Run the eval gate on the weights held; its decision joins the step records."""
        model = await self._model_for_eval()
        decision = await self._gate.decide_on(
            model, self.state.version, self._publisher, self._bus.js
        )
        if decision is not None:
            self._steps.write_decision(decision, self.state.step)

    async def _publish_weights(self) -> None:
        """Record the version as taken (KV), then hand a copy of the weights to the stager,
        which stages it in the background (a version still waiting is replaced: the newest
        ships first, libs/trainer/staging.py).

        The KV write comes first so a crash in between can only skip a number, never reuse it.
        """
        await self._record_progress()
        state = await self._published_state()
        await self._stager.offer(state, self.state.version, step=self.state.step)

    async def _published_state(self) -> dict[str, torch.Tensor]:
        """A copy of the weights as workers run them, owned by the caller."""
        return await asyncio.to_thread(self.precision.published_copy, self.model)

    async def _model_for_eval(self) -> PreTrainedModel:
        """The weights held, as a model the eval gate can generate with."""
        return self.model

    async def _record_progress(self) -> None:
        """Publish the version, the groups taken and the staleness bound to the KV bucket (the
        feeder reads them); rides through a NATS restart."""

        async def write() -> None:
            kv = await self._bus.js.key_value(streams.STATE.bucket)
            await kv.put(streams.POLICY_VERSION_KEY, str(self.state.version).encode())
            await kv.put(streams.GROUPS_TAKEN_KEY, str(self.state.groups_taken).encode())
            await kv.put(streams.MAX_STALENESS_KEY, str(self._max_staleness).encode())
            await kv.put(streams.BATCH_GROUPS_KEY, str(self.config.batch_groups).encode())

        await ride_through(write, "trainer progress")

    async def _announced_version(self) -> int | None:
        kv = await self._bus.js.key_value(streams.STATE.bucket)
        try:
            entry = await kv.get(streams.POLICY_VERSION_KEY)
        except KeyNotFoundError:
            return None
        return int((entry.value or b"0").decode())

    async def _save_checkpoint(self) -> None:
        """A checkpoint of the trainer as it is now: written in the background from a host
        copy (one write at a time; a failed write raises at the next checkpoint or at stop),
        or in line where `background_checkpoints` is off."""
        await self._checkpoint_written()  # its host buffers are the next copy's
        if not (self.background_checkpoints and self.config.checkpoint_in_background):
            await asyncio.to_thread(self._checkpoint)
            return
        write = await asyncio.to_thread(self._checkpoint_snapshot)
        self._checkpoint_write = asyncio.create_task(
            asyncio.to_thread(write), name="checkpoint-write"
        )

    async def _checkpoint_written(self) -> None:
        """Wait for the checkpoint being written in the background, if any."""
        task, self._checkpoint_write = self._checkpoint_write, None
        if task is not None:
            await task

    def _checkpoint(self) -> None:
        """Write a checkpoint of the trainer as it is now, in line."""
        self._checkpoint_writer(self._write_tensors)()

    def _checkpoint_snapshot(self) -> Callable[[], None]:
        """A writer of a checkpoint of the trainer as it is now, from a host copy of its
        tensors: it may run while training goes on."""
        copy = host_snapshot_writer(self.model, self.optimizer, self._host_copy)
        return self._checkpoint_writer(copy)

    def _checkpoint_writer(self, write_tensors: Callable[[Path], None]) -> Callable[[], None]:
        self.state.recent_groups = self._buffer.recently_taken
        state = msgspec.json.decode(msgspec.json.encode(self.state), type=TrainerState)
        protected = self._protected_versions()

        def write() -> None:
            path = write_checkpoint(
                self.paths.checkpoint_dir,
                state,
                write_tensors,
                self.tokenizer,
                keep=self.config.checkpoint_keep,
                protected=protected,
            )
            self._checkpointed_step = state.step
            log.info("checkpoint saved", path=str(path))

        return write

    def _write_tensors(self, folder: Path) -> None:
        """The checkpoint's weights and optimizer state, into `folder`."""
        write_model_and_optimizer(self.model, self.optimizer, folder)

    def _keeps_version(self) -> bool:
        """True when the eval gate just promoted the version held, or scored it the best yet:
        its checkpoint is written now and never pruned."""
        last = self._gate.last
        if last is None or last.version != self.state.version or self.state.step == 0:
            return False
        best = self.state.note_eval(last.version, last.candidate_score)
        return last.promoted or best

    def _protected_versions(self) -> set[int]:
        """Versions whose checkpoints are never pruned: serving, and best held-out score."""
        serving = self._gate.last.serving_version if self._gate.last else None
        return {v for v in (serving, self.state.best_eval_version) if v is not None}

    def _record(
        self, batch: Batch, stats: StepStats, step_s: float
    ) -> tuple[StepRecord, StepSamples]:
        rewards = [s.reward for s in batch.kept]
        tokens = stats.num_loss_tokens
        record = StepRecord(
            **self._step_fields(stats.policy, stats.mismatch, step_s),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            success=sum(map(is_success, batch.kept)) / max(len(batch.kept), 1),
            num_samples=len(batch.kept),
            num_rows=stats.num_rows,
            num_groups=len(batch.groups),
            num_zero_variance_groups=stats.num_zero_variance_groups,
            num_loss_tokens=tokens,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            staleness=batch.staleness,
            num_dropped=len(batch.dropped),
            wait_s=batch.wait_s,
            wait_weights_s=batch.weights_wait_s,
            tokens_per_s=tokens / max(step_s, 1e-9),
            samples_per_s=len(batch.kept) / max(step_s + batch.wait_s, 1e-9),
        )
        return record, self._samples(
            sample_ids=[s.rollout.rollout_id for s in batch.kept],
            dropped_ids=[s.rollout.rollout_id for s in batch.dropped],
            refused_ids=[s.rollout.rollout_id for s in batch.refused],
        )

    def _samples(self, **ids: Any) -> StepSamples:
        return StepSamples(step=self.state.step, segment=self.state.segment, **ids)

    def _step_fields(
        self, policy: PolicyLossStats, mismatch: MismatchStats, step_s: float
    ) -> dict[str, Any]:
        """The StepRecord fields every step reports, offline or online."""
        return {
            "step": self.state.step,
            "version": self.state.version,
            "segment": self.state.segment,
            "time": time.time(),
            "learning_rate": self.optimizer.param_groups[0]["lr"],
            "mismatch_tokens": mismatch.num_tokens,
            "mismatch_mean_abs": mismatch.mean_abs_diff,
            "mismatch_kl": mismatch.kl,
            "clip_fraction": policy.clip_fraction,
            "is_weight_mean": policy.is_weight_mean,
            "is_weight_max": policy.is_weight_max,
            "is_truncated_fraction": policy.is_truncated_fraction,
            "step_s": step_s,
            "busy_fraction": self._timers.busy_fraction,
        }

    def _online_record(
        self, taken: OnlineTake, stats: OnlineStepStats, step_s: float
    ) -> tuple[StepRecord, StepSamples]:
        record = StepRecord(
            **self._step_fields(stats.policy, stats.mismatch, step_s),
            mean_reward=stats.mean_reward,
            num_samples=len(taken.kept),
            num_rows=len(taken.kept),
            num_groups=0,
            num_zero_variance_groups=0,
            num_loss_tokens=stats.num_loss_tokens,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            staleness=taken.staleness,
            num_dropped=len(taken.stale),
            wait_s=0.0,
            tokens_per_s=stats.num_loss_tokens / max(step_s, 1e-9),
            samples_per_s=len(taken.kept) / max(step_s, 1e-9),
            stream="online",
            num_online_invalid=len(taken.invalid),
            online_mean_advantage=stats.mean_advantage,
            online_baselines=stats.baselines,
        )
        return record, self._samples(
            stream="online",
            sample_ids=[s.sample_id for s in taken.kept],
            dropped_ids=[s.sample_id for s in taken.stale + taken.invalid],
        )

    def health(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "detail": self.detail,
            "step": self.state.step,
            "policy_version": self.state.version,
            "groups_open": self._buffer.num_open,
            "groups_ready": self._buffer.num_ready,
            "busy_fraction": round(self._timers.busy_fraction, 3),
            "online_pending": self._online.num_pending if self._online is not None else 0,
            "promoted_version": self._gate.last.serving_version if self._gate.last else None,
            **self._steps.health_fields(),
        }
