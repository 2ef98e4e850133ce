"""The trainer's online samples: read from RL_ROLLOUTS_ONLINE at its own checkpointed cursor.

    source = OnlineSource(reader, state.online_cursor, problem_of, state.lineage.equivalent)
    await source.poll(read_batch=256, timeout_s=0.5)     # buffer what arrived
    source.num_fresh(version, max_staleness)             # trainable now
    taken = source.take(32, version, max_staleness)      # fresh ones, plus every drop
    ...train on taken.kept...; state.online_cursor.mark_done(taken.sequences)

Exactly once, as for scored rollouts (libs.trainer.cursor): a sample is consumed when the
step that trained on it (or dropped it) is recorded, and the cursor is saved with the model.
A take drops every buffered sample outside the staleness bound and every sample that
cannot be trained on (not training-eligible, no completion, logprobs missing), so drops
never wait for a fresh sample to come along. A sample `problem_of` refuses as it is read
(token ids outside the vocabulary, a version the trainer never made: libs.trainer.refusals),
and one the reader could not decode or validate, is dead-lettered and consumed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from libs.bus.stream_reader import StreamReader
from libs.rl.online import online_sample_problem, online_staleness
from libs.rl.staleness import staleness_histogram
from libs.trainer.cursor import ConsumedCursor
from proto.messages import OnlineSample

log = structlog.get_logger(__name__)


@dataclass
class OnlineTake:
    """Samples taken for one online step: trained, dropped as stale, refused as invalid."""

    kept: list[OnlineSample] = field(default_factory=list)
    stale: list[OnlineSample] = field(default_factory=list)
    invalid: list[OnlineSample] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)


class OnlineSource:
    """Buffers online samples not yet consumed, in stream order."""

    def __init__(
        self,
        reader: StreamReader[OnlineSample],
        cursor: ConsumedCursor,
        problem_of: Callable[[OnlineSample], str | None],
        equivalent: Callable[[int], int],
    ) -> None:
        self._reader = reader
        self._cursor = cursor
        self._problem_of = problem_of
        self._equivalent = equivalent  # versions across a resume (libs.trainer.lineage)
        self._pending: list[tuple[int, OnlineSample]] = []
        self._invalid: list[tuple[int, OnlineSample]] = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def poll(self, read_batch: int, timeout_s: float) -> None:
        """Buffer what the stream has (waits up to `timeout_s` when nothing is there)."""
        read = await self._reader.read(read_batch, timeout_s=timeout_s)
        self._cursor.mark_done(read.skipped)
        for record in read.records:
            if self._cursor.is_done(record.sequence):
                continue
            refusal = self._problem_of(record.message)
            if refusal is not None:
                await self._reader.refuse(record, refusal)
                self._cursor.mark_done([record.sequence])
                continue
            problem = online_sample_problem(record.message)
            if problem is None:
                self._pending.append((record.sequence, record.message))
                continue
            log.warning("online sample refused", sample_id=record.message.sample_id, why=problem)
            self._invalid.append((record.sequence, record.message))

    def num_fresh(self, trainer_version: int, max_staleness: int) -> int:
        """Buffered samples within the staleness bound now."""
        staleness = (
            online_staleness(s, trainer_version, self._equivalent) for _, s in self._pending
        )
        return sum(0 <= value <= max_staleness for value in staleness)

    def take(self, max_samples: int, trainer_version: int, max_staleness: int) -> OnlineTake:
        """Up to `max_samples` fresh samples (oldest first), with every stale or invalid one."""
        taken = OnlineTake(invalid=[sample for _, sample in self._invalid])
        taken.sequences = [seq for seq, _ in self._invalid]
        staleness_values, remaining = [], []
        for seq, sample in self._pending:
            staleness = online_staleness(sample, trainer_version, self._equivalent)
            if not 0 <= staleness <= max_staleness:
                taken.stale.append(sample)
            elif len(taken.kept) < max_samples:
                taken.kept.append(sample)
            else:
                remaining.append((seq, sample))
                continue
            taken.sequences.append(seq)
            staleness_values.append(staleness)
        taken.staleness = staleness_histogram(staleness_values)
        self._pending, self._invalid = remaining, []
        return taken

    async def close(self) -> None:
        await self._reader.close()
