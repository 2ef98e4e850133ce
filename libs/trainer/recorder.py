"""The step record: what each trainer step did, offline or online, and the eval gate's
decisions, written to the run's step log (libs.trainer.metrics: JSON lines, Prometheus,
the experiment trackers).

    recorder = StepRecorder(config, run_dir, state)
    recorder.start_clock()                              # busy fraction from now
    recorder.offline(batch, stats, step_s, learning_rate, max_staleness=4, pacing=decision)
    recorder.online(taken, stats, step_s, learning_rate)
    recorder.decision(decision, gate.last_transcripts)   # + a few held-out episodes

Each record carries the trainer's step, version and segment as `state` has them after the
step, and the busy fraction: the share of wall time spent in optimizer steps since the
clock started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.rl import MismatchStats, PolicyLossStats, staleness_buckets
from libs.rl.mismatch import ExactVersionMismatch
from libs.rollout.figures import episode_figures, is_success
from libs.rollout.transcripts import EpisodeText
from libs.trainer.checkpoint import TrainerState
from libs.trainer.config import TrainerConfig
from libs.trainer.metrics import (
    MismatchFigures,
    StepRecord,
    StepSamples,
    TranscriptRecord,
    open_step_log,
)
from libs.trainer.online_source import OnlineTake
from libs.trainer.online_step import OnlineStepStats
from libs.trainer.pacing import PacingDecision
from libs.trainer.samples import Batch
from libs.trainer.step import StepStats
from proto.messages import PromotionDecision, ScoredRollout


@dataclass(frozen=True)
class EpisodeFields:
    """The step record's tool-use and length figures of its fresh episodes, trained or skipped."""

    tool_call_validity: float | None
    turns_per_episode: float | None
    segments_per_episode: float | None


def episode_fields(kept: list[ScoredRollout]) -> EpisodeFields:
    figures = episode_figures(kept) if kept else {}
    return EpisodeFields(
        figures.get("tool_call_validity"),
        figures.get("turns_per_episode"),
        figures.get("segments_per_episode"),
    )


@dataclass
class Timers:
    started_s: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(time.monotonic() - self.started_s, 1e-9)


class StepRecorder:
    """Writes one trainer's step records and keeps its busy time."""

    def __init__(self, config: TrainerConfig, run_dir: Path, state: TrainerState) -> None:
        self._log = open_step_log(config, run_dir)  # the resolved config as run parameters
        self._state = state
        self._timers = Timers()

    def start_clock(self) -> None:
        self._timers = Timers()

    def count_busy(self, step_s: float) -> None:
        self._timers.busy_s += step_s

    def offline(
        self,
        batch: Batch,
        stats: StepStats,
        step_s: float,
        learning_rate: float,
        *,
        max_staleness: int,
        pacing: PacingDecision | None = None,
    ) -> None:
        """The record of an offline step: `max_staleness` the bound its samples were split
        by, `pacing` the pacer's decision after it (None: pacing off). Reward, success and
        the episode figures cover every fresh sample taken, trained or skipped: they describe
        the policy, and skipping all-success groups must not lower its reward curve."""
        fresh = batch.fresh
        rewards = [s.reward for s in fresh]
        episodes = episode_fields(fresh)
        tokens = stats.num_loss_tokens
        record = StepRecord(
            **self._step_fields(stats.policy, stats.mismatch, step_s, learning_rate),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            success=sum(map(is_success, fresh)) / max(len(fresh), 1),
            tool_call_validity=episodes.tool_call_validity,
            turns_per_episode=episodes.turns_per_episode,
            segments_per_episode=episodes.segments_per_episode,
            num_samples=len(batch.kept),
            num_rows=stats.num_rows,
            num_groups=len(batch.groups),
            num_zero_variance_groups=stats.num_zero_variance_groups,
            num_skipped_groups=len(batch.skipped_groups),
            num_loss_tokens=tokens,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            staleness=batch.staleness,
            num_dropped=len(batch.dropped),
            wait_s=batch.wait_s,
            wait_weights_s=batch.weights_wait_s,
            tokens_per_s=tokens / max(step_s, 1e-9),
            samples_per_s=len(batch.kept) / max(step_s + batch.wait_s, 1e-9),
            mismatch_by_staleness=mismatch_figures(stats.mismatch_by_staleness),
            routing_disagreement=stats.routing_disagreement,
            **exact_mismatch_fields(stats.mismatch_exact),
            max_staleness=max_staleness,
            pacing=pacing,
        )
        samples = self._samples(
            sample_ids=[s.rollout.rollout_id for s in batch.kept],
            dropped_ids=[s.rollout.rollout_id for s in batch.dropped],
            refused_ids=[s.rollout.rollout_id for s in batch.refused],
            skipped_ids=[s.rollout.rollout_id for s in batch.skipped],
        )
        self._log.write(record, samples)

    def online(
        self, taken: OnlineTake, stats: OnlineStepStats, step_s: float, learning_rate: float
    ) -> None:
        record = StepRecord(
            **self._step_fields(stats.policy, stats.mismatch, step_s, learning_rate),
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
            routing_disagreement=stats.routing_disagreement,
        )
        samples = self._samples(
            stream="online",
            sample_ids=[s.sample_id for s in taken.kept],
            dropped_ids=[s.sample_id for s in taken.stale + taken.invalid],
        )
        self._log.write(record, samples)

    def decision(self, decision: PromotionDecision, transcripts: list[EpisodeText]) -> None:
        """An eval-gate decision, at the trainer's step, and a few of its held-out episodes."""
        self._log.write_decision(decision, self._state.step)
        step, version = self._state.step, decision.version
        records = [TranscriptRecord(step=step, version=version, episode=t) for t in transcripts]
        self._log.write_transcripts(records)

    def _samples(self, **ids: Any) -> StepSamples:
        return StepSamples(step=self._state.step, segment=self._state.segment, **ids)

    def _step_fields(
        self, policy: PolicyLossStats, mismatch: MismatchStats, step_s: float, learning_rate: float
    ) -> dict[str, Any]:
        """The StepRecord fields every step reports, offline or online."""
        return {
            "step": self._state.step,
            "version": self._state.version,
            "segment": self._state.segment,
            "time": time.time(),
            "learning_rate": learning_rate,
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

    def health_fields(self) -> dict[str, Any]:
        return {
            "busy_fraction": round(self._timers.busy_fraction, 3),
            **self._log.health_fields(),
        }

    def close(self) -> None:
        self._log.close()


def mismatch_figures(levels: dict[int, MismatchStats]) -> dict[str, MismatchFigures]:
    """Per-staleness mismatch as the record carries it: buckets "0", "1", "2", "3+", "all"."""
    return {bucket: figures_of(stats) for bucket, stats in staleness_buckets(levels).items()}


def exact_mismatch_fields(exact: ExactVersionMismatch | None) -> dict[str, Any]:
    """The record's mismatch_exact fields (none on a step not measured)."""
    if exact is None:
        return {}
    return {
        "mismatch_exact": {bucket: figures_of(s) for bucket, s in exact.by_gap.items()},
        "mismatch_exact_unscored": exact.num_unscored,
    }


def figures_of(stats: MismatchStats) -> MismatchFigures:
    return MismatchFigures(
        tokens=stats.num_tokens,
        kl=stats.kl,
        mean_abs=stats.mean_abs_diff,
        is_weight_mean=stats.is_weight_mean,
        is_outside_fraction=stats.is_outside_fraction,
    )
