"""The trainer's loop: fetch samples, step, publish the version, record, gate, checkpoint.

    trainer = Trainer(config, run_dir, bus, publisher)   # resumes from the latest checkpoint
    await trainer.setup()      # announce the weights held as a new version; the gate resumes
    await trainer.run()        # until stop() or max_steps; checkpoints on the way out

Each step, in order, through the trainer's components (each owns its state):

    work  <- SampleSource.next()          offline: complete groups, stale samples dropped;
                                          online: fresh feedback samples (libs.trainer.mix)
    stats <- Learner.train(work)          in a worker thread, on 1 rank or N
    version += 1
    StalenessPacer.observe(stats)         offline, pacing on: the staleness bound moved by
                                          the mismatch measured (libs.trainer.pacing)
    StepRecorder.offline/online(...)      the step's record, the pacer's decision in it
    VersionPublisher.publish()            the weights staged, the bound to the KV bucket
    EvalGate every N versions; Checkpointer.save() every N steps (and a kept version)

Exactly-once: the scored and online streams are read from the checkpoint's cursors; a sample
is marked consumed when its step (or its drop) is recorded, and the cursor is saved with the
model. A sample copied twice on the stream is consumed once (libs.trainer.samples).

No sample can stop the loop: what the source refuses as it reads, and the samples that make
an optimizer step fail on their own, are dead-lettered with the reason and consumed; the step
trains the rest. Only a failure no sample reproduces (the trainer's own bug) ends the process.
After a crash, everything the last checkpoint had not consumed is read again, and nothing it
had is; versions never repeat (libs.trainer.versions).

Parallelism is the learner's: under torchrun this loop is rank 0 of the job, its learner a
`RankLearner` that runs each operation on every rank (libs.trainer.ranks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from transformers import PreTrainedModel

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.envs.client import EnvClient
from libs.logs import bind_context
from libs.policy import load_policy_tokenizer, tokenizer_spec
from libs.policy_identity import describe_policy
from libs.trainer.checkpoint import TrainerState
from libs.trainer.checkpointer import Checkpointer
from libs.trainer.config import TrainerConfig
from libs.trainer.eval_gate import EvalGate
from libs.trainer.learner import setup_learner
from libs.trainer.online_source import OnlineTake
from libs.trainer.pacing import PacingDecision, StalenessPacer
from libs.trainer.recorder import StepRecorder
from libs.trainer.refusals import model_vocab_size, policy_routing
from libs.trainer.samples import Batch, SampleSource
from libs.trainer.schedule import learning_rate_at, learning_rate_of, set_learning_rate
from libs.trainer.step import StepStats
from libs.trainer.versions import VersionPublisher
from libs.weights.handoff import default_staging_dir

log = structlog.get_logger(__name__)


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a trainer keeps its checkpoints under the run folder."""
    return run_dir / "trainer" / "checkpoints"


class Trainer:
    """The loop over the trainer's components: the policy's learner, the sample source, the
    version publisher, the step recorder, the eval gate and the checkpointer."""

    def __init__(
        self, config: TrainerConfig, run_dir: Path, bus: Bus, publisher: Publisher
    ) -> None:
        # The tokenizer is resolved once: a checkpoint folder resumed from keeps using it.
        self.policy = config.policy.model_copy(update={"tokenizer": tokenizer_spec(config.policy)})
        self.tokenizer = load_policy_tokenizer(self.policy)
        self.learner = setup_learner(config, self.policy, self.tokenizer)
        self.config = config = self.learner.config  # sized for the model
        self._checkpointer = Checkpointer(
            checkpoint_dir(run_dir), self.learner, self.tokenizer, config
        )
        resumed = self._checkpointer.resume()
        self._resumed = resumed is not None
        if resumed is not None:
            resumed.segment += 1  # the records of steps redone after it are told apart
        self.state = resumed or TrainerState(step=0, version=0)
        self._stopping = asyncio.Event()
        self._recorder = StepRecorder(config, run_dir, self.state)
        self._versions = VersionPublisher(
            bus, publisher, self.learner, self.state, default_staging_dir(run_dir)
        )
        model = self.learner.model
        self._source = SampleSource(
            bus,
            publisher,
            config,
            self.state,
            self._versions,
            model_vocab_size(model),
            policy_routing(model),
            self._stopping,
        )
        assert config.max_staleness is not None, "the learner sizes the config"
        self.max_staleness = config.max_staleness
        # None: the bound stays as configured (pacing off, or 0: the synchronous baseline).
        self._pacer = (
            StalenessPacer(config.pacing, start=config.max_staleness)
            if config.pacing.enabled and config.max_staleness > 0
            else None
        )
        if self._pacer is not None:
            self._set_max_staleness(self._pacer.bound)
        self._gate = EvalGate(config.eval, self.policy, self.tokenizer, EnvClient(bus.nc))
        self._bus = bus
        self._publisher = publisher
        self.status = "starting"

    @property
    def model(self) -> PreTrainedModel:
        """The policy trained (this rank's shard of it with N ranks)."""
        return self.learner.model

    async def setup(self) -> None:
        """Publish the weights held (resumed or built) as a new version; resume the gate."""
        identity = describe_policy(
            self.model.config, self.model.state_dict(), self.tokenizer, tokenizer_spec(self.policy)
        )
        await self._versions.start(identity, resumed=self._resumed)
        await self._gate.setup(self._bus.js)
        if self._gate.config.enabled and self._gate.last is None:
            await self._decide()  # nothing promoted yet: the weights we start from are judged
        self.status = "ok"

    async def run(self) -> None:
        """Train until stopped or `max_steps` is reached; checkpoint on the way out."""
        self._recorder.start_clock()
        try:
            while not self._stopping.is_set() and not self._reached_max_steps():
                work = await self._source.next()
                if work is None:
                    break
                if isinstance(work, OnlineTake):
                    await self._train_online(work)
                else:
                    await self._train(work)
        finally:
            await self._finish()
        # Only after a clean finish: when rank 0 fails, torchrun stops the other ranks.
        await asyncio.to_thread(self.learner.close)

    async def stop(self) -> None:
        self._stopping.set()

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    async def _train(self, batch: Batch) -> None:
        self._set_learning_rate()
        started_s = time.monotonic()
        stats = await self._train_isolating(batch)
        if stats is None:  # every fresh sample was refused: consumed, no step
            self.state.scored_cursor.mark_done(batch.sequences)
            await self._versions.record_progress()
            return
        step_s = self._advance(started_s)
        self.state.scored_cursor.mark_done(batch.sequences)
        bound = self.max_staleness
        self._recorder.offline(
            batch,
            stats,
            step_s,
            learning_rate_of(self.learner.optimizer),
            max_staleness=bound,
            pacing=self._pace(batch, stats),
        )
        await self._after_step()

    async def _train_isolating(self, batch: Batch) -> StepStats | None:
        """The learner's step on the batch; when it fails, dead-letter the samples that fail
        alone and train the rest (None when none is left). Raises when no sample is to blame."""
        while batch.kept:
            try:
                return await asyncio.to_thread(
                    self.learner.train,
                    batch.kept,
                    self.state.version,
                    self.state.lineage,
                    self.max_staleness,
                )
            except Exception as exc:
                failing = await asyncio.to_thread(self.learner.failing_samples, batch.kept)
                if not failing or (len(failing) == len(batch.kept) > 1):
                    raise  # not one sample's fault: the trainer's own bug
                log.error("step failed on samples; dead-lettering them", error=repr(exc))
                await self._source.refuse_failing(batch, failing)
        return None

    async def _train_online(self, taken: OnlineTake) -> None:
        assert taken.kept, "an online step is chosen only with fresh samples"
        self._set_learning_rate(scale=self.config.online.learning_rate_scale)
        started_s = time.monotonic()
        stats = await asyncio.to_thread(
            self.learner.train_online, taken.kept, self.state.online_baselines, self.state.version
        )
        step_s = self._advance(started_s)
        self.state.online_cursor.mark_done(taken.sequences)
        self._recorder.online(taken, stats, step_s, learning_rate_of(self.learner.optimizer))
        await self._after_step()

    def _pace(self, batch: Batch, stats: StepStats) -> PacingDecision | None:
        """The pacer's decision on this step's mismatch; the new bound applies from the next
        step on, and reaches the feeder with this step's progress (None: pacing off)."""
        if self._pacer is None:
            return None
        decision = self._pacer.observe(
            self.state.step, stats.mismatch_by_staleness, len(batch.fresh), len(batch.dropped)
        )
        if decision.bound_after != decision.bound_before:
            log.info("staleness bound moved", **msgspec.structs.asdict(decision))
        self._set_max_staleness(self._pacer.bound)
        return decision

    def _set_max_staleness(self, bound: int) -> None:
        """The bound the learner, the sample source and the feeder (through the KV) use."""
        self.max_staleness = bound
        self._source.max_staleness = bound
        self._versions.max_staleness = bound

    def _set_learning_rate(self, scale: float = 1.0) -> None:
        rate = learning_rate_at(self.config, self.state.step)
        set_learning_rate(self.learner.optimizer, scale * rate)

    def _advance(self, started_s: float) -> float:
        """Count the step and the new version; returns the step's seconds."""
        step_s = time.monotonic() - started_s
        self._recorder.count_busy(step_s)
        self.state.step += 1
        self.state.version += 1
        bind_context(step=self.state.step, policy_version=self.state.version)
        return step_s

    async def _after_step(self) -> None:
        """Publish (or record progress), gate a published version when due, checkpoint."""
        published = self.state.step % self.config.publish_every_steps == 0
        if published:
            await self._versions.publish()
        else:
            await self._versions.record_progress()
        if published and self._gate.due(self.state.version):
            await self._decide()
        kept = self._keeps_version()  # first: it also notes the best held-out score
        if kept or self.state.step % self.config.checkpoint_every_steps == 0:
            await self._save_checkpoint()

    async def _decide(self) -> None:
        """Run the eval gate on the weights held; its decision joins the step records."""
        model = await asyncio.to_thread(self.learner.model_for_eval)
        decision = await self._gate.decide_on(
            model, self.state.version, self._publisher, self._bus.js
        )
        if decision is not None:
            self._recorder.decision(decision, self._gate.last_transcripts)

    def _keeps_version(self) -> bool:
        """True when the eval gate just promoted the version held, or scored it the best yet:
        its checkpoint is written now and never pruned."""
        last = self._gate.last
        if last is None or last.version != self.state.version or self.state.step == 0:
            return False
        best = self.state.note_eval(last.version, last.candidate_score)
        return last.promoted or best

    async def _save_checkpoint(self, in_line: bool = False) -> None:
        """A checkpoint of the trainer as it is now (libs.trainer.checkpointer)."""
        self.state.recent_groups = self._source.recent_groups
        # Never pruned: the version serving, and the best held-out score.
        serving = self._gate.last.serving_version if self._gate.last else None
        protected = {v for v in (serving, self.state.best_eval_version) if v is not None}
        save = self._checkpointer.save_in_line if in_line else self._checkpointer.save
        await save(self.state, protected)

    async def _finish(self) -> None:
        """Stage the last version, make sure the last step has a checkpoint (once: not again
        when its own was just written; in line when the background write failed), close the
        readers and the step records. Each part runs whatever the ones before did, so a
        failed write loses neither the final checkpoint nor the records; the first failure
        is raised after all of them."""
        failures: list[Exception] = []

        async def attempt(part: Awaitable[object], what: str) -> None:
            try:
                await part
            except Exception as exc:  # raised below, after the rest of the cleanup
                log.error("trainer stop failed", part=what, error=repr(exc))
                failures.append(exc)

        await attempt(self._versions.close(), "stage the last version")
        await attempt(self._checkpointer.written(), "background checkpoint")
        if self.state.step > 0 and self._checkpointer.saved_step != self.state.step:
            await attempt(self._save_checkpoint(in_line=True), "final checkpoint")
        await attempt(self._source.close(), "close the readers")
        self._recorder.close()
        if failures:
            raise failures[0]

    def health(self) -> dict[str, Any]:
        last = self._gate.last
        return {
            "status": self.status,
            "detail": self._source.detail,
            "step": self.state.step,
            "policy_version": self.state.version,
            "promoted_version": last.serving_version if last else None,
            **self._source.health_fields(),
            **self._recorder.health_fields(),
            **self.learner.health_fields(),
        }
