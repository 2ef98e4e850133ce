"""The trainer's sample source: what the next step trains on, read exactly once.

    source = SampleSource(bus, publisher, config, state, versions, vocab_size, routing, stopping)
    work = await source.next()   # a Batch of scored groups, an OnlineTake, None: stopping
    ...train...; state.scored_cursor.mark_done(batch.sequences)
    await source.refuse_failing(batch, failing)   # dead-letter samples a step failed on

It owns the trainer's readers of the scored and online streams (from the checkpoint's
cursors in `state`), the buffer of groups being completed (libs.trainer.groups), and the
rules that decide what is trained:
- the mix: which stream a step trains on (libs.trainer.mix, `online.fraction`);
- staleness: groups are taken until `batch_groups` of them have samples fresh enough
  against the trainer's version (across resumes: libs.trainer.lineage); the stale ones are
  dropped, reported with the batch, and the feeder told at once;
- zero-variance groups (`zero_variance_groups` "skip"): a group whose fresh samples all got
  the same reward is consumed like a dropped one but not trained on, and the batch waits
  for `batch_groups` groups whose rewards differ;
- refusals: what the reader cannot decode or validate, what the trainer cannot train on
  (libs.trainer.refusals) and copies of samples already taken are dead-lettered and
  consumed as they are read;
- back-pressure on weights: ready groups are held back while the newest announced version
  is so far behind the trainer's that every sample generated now would be dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import structlog

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.bus.stream_reader import StreamReader, StreamRecord
from libs.rl import has_reward_variance, split_by_staleness, staleness_histogram
from libs.trainer.checkpoint import TrainerState
from libs.trainer.config import TrainerConfig
from libs.trainer.groups import Group, GroupBuffer
from libs.trainer.mix import Stream, choose_stream, scheduled_stream
from libs.trainer.online_source import OnlineSource, OnlineTake
from libs.trainer.refusals import online_problem, scored_problem
from libs.trainer.versions import VersionPublisher
from libs.weights.announcements import latest_announcement
from proto import streams, subjects
from proto.messages import OnlineSample, ScoredRollout

log = structlog.get_logger(__name__)

# Scored or online messages read from the stream at once.
READ_BATCH = 256


@dataclass
class Batch:
    """Groups taken for one step, split by staleness; `groups` are trained (or wholly
    dropped as stale), `skipped_groups` are consumed without training."""

    groups: list[Group]
    kept: list[ScoredRollout]
    dropped: list[ScoredRollout]
    staleness: dict[int, int]
    wait_s: float
    # Of wait_s, the time samples were ready but held back until the trainer's weights
    # reached the workers (back-pressure on weights).
    weights_wait_s: float = 0.0
    # Samples dead-lettered because the step failed on them alone.
    refused: list[ScoredRollout] = field(default_factory=list)
    # Groups left out as their fresh samples all got the same reward (zero_variance_groups
    # "skip"), and those fresh samples (their stale ones are in `dropped`).
    skipped_groups: list[Group] = field(default_factory=list)
    skipped: list[ScoredRollout] = field(default_factory=list)

    @property
    def taken_groups(self) -> list[Group]:
        """Every group taken from the buffer for this step: consumed with it."""
        return self.groups + self.skipped_groups

    @property
    def sequences(self) -> list[int]:
        return [seq for group in self.taken_groups for seq in group.sequences]

    @property
    def fresh(self) -> list[ScoredRollout]:
        """The fresh samples taken, trained or skipped: what the policy did lately, so the
        reward curve does not drop when all-success groups are skipped."""
        return self.kept + self.skipped


class SampleSource:
    """Reads the trainer's streams and hands each step its samples."""

    def __init__(
        self,
        bus: Bus,
        publisher: Publisher,
        config: TrainerConfig,
        state: TrainerState,
        versions: VersionPublisher,
        vocab_size: int,
        routing: tuple[int, int] | None,
        stopping: asyncio.Event,
    ) -> None:
        assert config.max_staleness is not None, "the learner sizes the config"
        # The bound samples are split by; the trainer's pacer moves it (libs.trainer.pacing).
        self.max_staleness = config.max_staleness
        self._config = config
        self._state = state
        self._versions = versions
        self._vocab_size = vocab_size
        self._routing = routing  # the policy's (MoE layers, top_k); None: dense
        self._stopping = stopping
        self._js = bus.js
        self._buffer = GroupBuffer(config.incomplete_group_timeout_s, taken=state.recent_groups)
        self._scored = StreamReader(
            bus.js,
            streams.ROLLOUTS_SCORED.name,
            subjects.ROLLOUTS_SCORED,
            ScoredRollout,
            publisher,
            start_sequence=state.scored_cursor.floor + 1,
            reader_name="trainer",
        )
        # None: online training off (online.fraction 0).
        self._online = self._setup_online(bus, publisher) if config.online.fraction > 0 else None
        self.detail = ""

    def _setup_online(self, bus: Bus, publisher: Publisher) -> OnlineSource:
        reader = StreamReader(
            bus.js,
            streams.ROLLOUTS_ONLINE.name,
            subjects.ROLLOUTS_ONLINE,
            OnlineSample,
            publisher,
            start_sequence=self._state.online_cursor.floor + 1,
            reader_name="trainer-online",
        )
        return OnlineSource(
            reader, self._state.online_cursor, self._online_problem, self._equivalent
        )

    def _equivalent(self, version: int) -> int:
        """`version` across resumes; the lineage is read now: a start may extend it."""
        return self._state.lineage.equivalent(version)

    @property
    def recent_groups(self) -> list[str]:
        """Group ids taken lately, for the checkpoint (a later copy is a duplicate)."""
        return self._buffer.recently_taken

    async def next(self) -> Batch | OnlineTake | None:
        """The samples of the next step, from the stream the mix picks; None when stopping."""
        if self._online is None:  # online training off: the batch waits for groups itself
            return await self._next_batch()
        stream = await self._choose_stream(self._online)
        if stream == "online":
            online = self._config.online
            version = self._state.version
            return self._online.take(online.batch_samples, version, online.max_staleness)
        if stream == "offline":
            return await self._next_batch()
        return None

    async def _choose_stream(self, source: OnlineSource) -> Stream | None:
        """The stream this step trains on (libs.trainer.mix); None when stopping first."""
        online = self._config.online
        scheduled = scheduled_stream(self._state.step, online.fraction)
        started_s = time.monotonic()
        while not self._stopping.is_set():
            choice = choose_stream(
                scheduled,
                offline_ready=self._buffer.num_ready > 0,
                online_fresh=source.num_fresh(self._state.version, online.max_staleness),
                online_batch_samples=online.batch_samples,
                online_fraction=online.fraction,
                waited_s=time.monotonic() - started_s,
                stream_wait_s=online.stream_wait_s,
            )
            if choice is not None:
                return choice
            if online.fraction < 1.0:
                await self._poll_scored(timeout_s=0.25)
            await source.poll(READ_BATCH, timeout_s=0.25)
        return None

    async def _next_batch(self) -> Batch | None:
        """Take groups until `batch_groups` of them are trained on: have samples fresh
        enough and, with zero_variance_groups "skip", rewards that differ.

        Stale samples are dropped and zero-variance groups skipped as their groups are
        taken, so a step always trains on a full batch; the dropped and skipped ones are
        reported with it. None when stopping first.
        """
        started_s = time.monotonic()
        self.detail = "" if self._state.step else "waiting for the first rollouts"
        batch = Batch(groups=[], kept=[], dropped=[], staleness={}, wait_s=0.0)
        staleness: list[int] = []
        num_trained_groups = 0
        while num_trained_groups < self._config.batch_groups:
            waited_s = await self._fill_buffer()
            if waited_s is None:  # not consumed: read again after a resume
                self._buffer.put_back(batch.taken_groups)
                self._state.groups_taken -= len(batch.taken_groups)
                return None
            batch.weights_wait_s += waited_s
            groups = self._buffer.take(self._config.batch_groups - num_trained_groups)
            num_trained = sum(self._split(group, batch, staleness) for group in groups)
            num_trained_groups += num_trained
            self._state.groups_taken += len(groups)
            if num_trained < len(groups):
                # Dropped and skipped groups free the feeder's room now, or a loop whose
                # samples all went stale (or all agree) would wait for tasks the feeder
                # holds back for it.
                await self._versions.record_progress()
            self._report_skipped(batch, num_trained_groups)
        batch.staleness = staleness_histogram(staleness)
        batch.wait_s = time.monotonic() - started_s
        return batch

    def _split(self, group: Group, batch: Batch, staleness: list[int]) -> bool:
        """Add `group` to `batch`, its stale samples dropped, skipped when its fresh ones
        all got the same reward ("skip"); True when some are kept to train on."""
        split = split_by_staleness(
            group.rollouts, self._state.version, self.max_staleness, self._equivalent
        )
        batch.dropped += split.dropped
        staleness += split.staleness
        if split.kept and self._skips(group, split.kept):
            batch.skipped_groups.append(group)
            batch.skipped += split.kept
            return False
        batch.groups.append(group)
        batch.kept += split.kept
        return bool(split.kept)

    def _skips(self, group: Group, kept: list[ScoredRollout]) -> bool:
        """Whether `group`, of fresh samples `kept`, is left out of the batch: "skip" and
        all its fresh samples got the same reward (their advantages would all be 0)."""
        # A group of one sample (task group_size 1) never has variance, so skipping it would
        # starve the run. The trainer cannot refuse the combination at start: the group size
        # is the environment's, carried by each task. Such groups train as with "train".
        if self._config.zero_variance_groups == "train" or group.size == 1:
            return False
        return not has_reward_variance([sample.reward for sample in kept])

    def _report_skipped(self, batch: Batch, num_trained_groups: int) -> None:
        """Say in the health answer when the step waits for groups whose rewards differ."""
        if batch.skipped_groups and num_trained_groups < self._config.batch_groups:
            self.detail = (
                f"{len(batch.skipped_groups)} groups skipped for this step (all their "
                "rewards equal); waiting for groups whose rewards differ"
            )

    async def _fill_buffer(self) -> float | None:
        """Read until at least one group is ready and the workers can have weights fresh
        enough to train on; returns the seconds spent holding ready groups back for the
        weights, None when stopping first."""
        weights_wait_s = 0.0
        while True:
            # A version that failed to stage never reaches the workers, whose samples may
            # wait for it: stop loudly (and be restarted) rather than wait forever.
            self._versions.raise_if_failed()
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
            found = [await latest_announcement(self._js, k) for k in ("delta", "snapshot")]
        except (nats.errors.Error, TimeoutError) as exc:  # the bus is away: reads wait anyway
            log.warning("cannot read the announced version", error=repr(exc))
            return True
        versions = [announcement.version for _, announcement in filter(None, found)]
        # A version this host's workers took from the trainer's memory has reached them,
        # whatever the chain's lag (at 3B the chain staged a version in seconds while the
        # host's worker had each in 0.2 s, and the trainer waited on the chain).
        versions += [v for v in (self._versions.shared_version,) if v is not None]
        if versions_reachable(
            self._state.version, versions, self.max_staleness, self._config.publish_every_steps
        ):
            return True
        self.detail = f"waiting for version {self._state.version} to reach the workers"
        return False

    async def _poll_scored(self, timeout_s: float) -> None:
        """Buffer what the scored stream has (waits up to `timeout_s` when it has nothing);
        what the reader dead-lettered, and what is refused here, is consumed at once."""
        read = await self._scored.read(READ_BATCH, timeout_s=timeout_s)
        cursor = self._state.scored_cursor
        cursor.mark_done(read.skipped)
        for record in read.records:
            if cursor.is_done(record.sequence):
                continue
            problem = scored_problem(
                record.message,
                vocab_size=self._vocab_size,
                routing=self._routing,
                trainer_version=self._state.version,
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
        await self._scored.refuse(record, error, reason)
        self._state.scored_cursor.mark_done([record.sequence])

    async def refuse_failing(self, batch: Batch, failing: list[tuple[ScoredRollout, str]]) -> None:
        """Dead-letter the samples an optimizer step failed on alone; the batch keeps the rest."""
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

    def _online_problem(self, sample: OnlineSample) -> str | None:
        return online_problem(
            sample,
            vocab_size=self._vocab_size,
            routing=self._routing,
            trainer_version=self._state.version,
        )

    def health_fields(self) -> dict[str, Any]:
        return {
            "groups_open": self._buffer.num_open,
            "groups_ready": self._buffer.num_ready,
            "online_pending": self._online.num_pending if self._online is not None else 0,
        }

    async def close(self) -> None:
        """Close the readers (the online one even when closing the scored one failed)."""
        try:
            await self._scored.close()
        finally:
            if self._online is not None:
                await self._online.close()


def versions_reachable(
    trainer_version: int, offered: list[int], max_staleness: int, publish_every_steps: int
) -> bool:
    """Whether workers can have weights fresh enough to train on: the newest version
    `offered` (announced on the chain, or shared on this host) is at most one version short
    of `max_staleness` behind the trainer, so samples of it in the buffer and in flight stay
    trainable. True when nothing was offered yet (no broadcaster)."""
    if not offered:
        return True
    allowed = max(max_staleness - 1, publish_every_steps - 1, 0)
    return trainer_version - max(offered) <= allowed
