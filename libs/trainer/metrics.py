"""Per-step trainer metrics: JSON lines, Prometheus, and the experiment trackers.

The run's history lives in `<run>/trainer/`:
- `steps.jsonl`: one `StepRecord` a step (reward, success, learning rate, staleness,
  mismatch per staleness, and per version gap with each token under its own version,
  importance weights, the staleness bound and the pacer's decision, throughput, busy
  fraction), readable by eye and by `rlpipe report`;
- `step_samples.jsonl`: one `StepSamples` a step, the ids of the samples it trained on,
  dropped, refused or skipped (so a resumed run can be checked for lost or repeated samples);
- `evals.jsonl`: one `EvalRecord` per eval-gate decision.
A resumed trainer redoes the steps after its checkpoint under a new `segment`; for each step
the record of the latest segment counts (`latest_per_step`).

The same figures go to the trackers the config names (libs.tracking) as `group/name` scalars.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from libs.rollout.transcripts import EpisodeText
from libs.tracking import Tracking, build_tracking
from libs.trainer.pacing import PacingDecision
from proto.messages import PromotionDecision

if TYPE_CHECKING:  # the config pulls in torch; readers of the records (rlpipe report) do not
    from libs.trainer.config import TrainerConfig

STEP = Gauge("rlpipe_trainer_step", "Optimizer steps taken")
VERSION = Gauge("rlpipe_trainer_policy_version", "Policy version the trainer holds")
REWARD = Gauge("rlpipe_trainer_mean_reward", "Mean reward of the last step's samples")
STALENESS = Histogram(
    "rlpipe_trainer_sample_staleness_versions",
    "Versions between a sample's policy and the trainer's, at training time",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
DROPPED = Counter("rlpipe_trainer_dropped_samples_total", "Samples dropped as too stale")
SKIPPED_GROUPS = Counter(
    "rlpipe_trainer_skipped_groups_total",
    "GRPO groups consumed without training as their rewards were all equal "
    "(trainer.zero_variance_groups skip)",
)
MISMATCH = Gauge(
    "rlpipe_trainer_logprob_mismatch_nats", "Mean |trainer - inference| logprob, same version"
)
MISMATCH_KL = Gauge("rlpipe_trainer_mismatch_kl_nats", "k3 KL(inference || trainer), same version")
ROUTING_DISAGREEMENT = Gauge(
    "rlpipe_trainer_routing_disagreement_ratio",
    "MoE: fraction of token-layer pairs the trainer's own router sent to another expert set "
    "than the engine did (last step)",
)
OFF_POLICY_KL = Gauge(
    "rlpipe_trainer_off_policy_kl_nats",
    "k3 KL(behavior || trainer) of the last step's trained tokens, by staleness bucket",
    ["staleness"],
)
OFF_POLICY_OUTSIDE = Gauge(
    "rlpipe_trainer_off_policy_is_outside_fraction",
    "Fraction of the last step's trained tokens whose importance weight left [1/cap, cap]",
    ["staleness"],
)
EXACT_MISMATCH = Gauge(
    "rlpipe_trainer_exact_mismatch_nats",
    "Mean |trainer - inference| logprob, each token under its own version, by version gap",
    ["gap"],
)
EXACT_MISMATCH_KL = Gauge(
    "rlpipe_trainer_exact_mismatch_kl_nats",
    "k3 KL(inference || trainer), each token under its own version, by version gap",
    ["gap"],
)
STALENESS_BOUND = Gauge("rlpipe_trainer_max_staleness_versions", "Staleness bound of the last step")
CLIP = Gauge("rlpipe_trainer_clip_fraction", "Fraction of tokens whose gradient the clip removed")
IS_WEIGHT = Gauge("rlpipe_trainer_importance_weight_mean", "Mean truncated importance weight")
TOKENS_PER_S = Gauge("rlpipe_trainer_tokens_per_second", "Trained tokens per second of step time")
BUSY = Gauge("rlpipe_trainer_busy_fraction", "Fraction of wall time spent in optimizer steps")
STEP_SECONDS = Histogram("rlpipe_trainer_step_seconds", "Time of one optimizer step")
ONLINE_REWARD = Gauge(
    "rlpipe_trainer_online_mean_reward", "Mean mapped reward of the last online step's samples"
)
ONLINE_SAMPLES = Counter("rlpipe_trainer_online_samples_total", "Online samples trained on")
ONLINE_DROPPED = Counter(
    "rlpipe_trainer_online_dropped_samples_total", "Online samples dropped", ["reason"]
)
ONLINE_BASELINE = Gauge(
    "rlpipe_trainer_online_baseline", "Running reward baseline per context kind", ["kind"]
)
LEARNING_RATE = Gauge("rlpipe_trainer_learning_rate", "Learning rate of the last step")

STEPS_FILE = Path("trainer") / "steps.jsonl"
STEP_SAMPLES_FILE = Path("trainer") / "step_samples.jsonl"
EVALS_FILE = Path("trainer") / "evals.jsonl"
TRANSCRIPTS_FILE = Path("trainer") / "eval_transcripts.jsonl"
# Steps whose rewards make the "recent" figures of the trainer's health answer.
RECENT_STEPS = 10


class MismatchFigures(msgspec.Struct, kw_only=True):
    """Behavior-vs-trainer mismatch of a set of trained tokens (libs.rl.mismatch)."""

    tokens: int
    kl: float  # k3 KL(behavior || trainer), nats per token
    mean_abs: float  # mean |trainer - behavior| logprob, nats
    is_weight_mean: float  # mean raw importance weight exp(trainer - behavior)
    is_outside_fraction: float  # share of weights outside [1/cap, cap] (importance_weight_cap)


class StepRecord(msgspec.Struct, kw_only=True):
    """Everything the trainer reports about one step."""

    step: int
    version: int
    segment: int
    time: float
    mean_reward: float
    # Fraction of samples whose environment said the answer is right (None: online steps).
    success: float | None = None
    learning_rate: float = 0.0
    num_samples: int
    # Training rows: one per sample, one per context segment of a self-summarizing episode.
    num_rows: int = 0
    num_groups: int
    # Trained groups whose samples all got the same reward (advantage 0 on every sample).
    num_zero_variance_groups: int
    # Groups taken for this step and consumed without training, as their fresh samples all
    # got the same reward (trainer.zero_variance_groups "skip"; 0 with "train"). The reward
    # and success figures above cover their samples too; num_samples does not.
    num_skipped_groups: int = 0
    num_loss_tokens: int
    loss: float
    grad_norm: float
    staleness: dict[int, int]
    num_dropped: int
    mismatch_tokens: int
    mismatch_mean_abs: float
    mismatch_kl: float
    # MoE rollouts with routing: the fraction of token-layer pairs whose expert set the
    # trainer's own router chose differently from the engine (libs.trainer.router_replay);
    # None for dense policies.
    routing_disagreement: float | None = None
    clip_fraction: float
    is_weight_mean: float
    is_weight_max: float
    is_truncated_fraction: float
    step_s: float
    # Seconds between the previous step and this one, and of those, the seconds complete
    # groups were ready but the trainer held back until its newest weights reached the
    # workers (their announced version too far behind: samples made now would only be
    # dropped as stale). The rest waited for samples.
    wait_s: float
    wait_weights_s: float = 0.0
    tokens_per_s: float
    samples_per_s: float
    busy_fraction: float
    # Which stream the step trained on: "offline" (scored GRPO groups) or "online" (product
    # feedback). For an online step the fields above describe its online samples
    # (mean_reward: the mean mapped reward; num_groups 0), and these add the rest.
    stream: str = "offline"
    num_online_invalid: int = 0
    online_mean_advantage: float = 0.0
    # Running baseline of each context kind in the step, after the step's updates.
    online_baselines: dict[str, float] = msgspec.field(default_factory=dict)
    # The mismatch of every trained token by its staleness: "0", "1", "2", "3+" and "all"
    # (the mismatch_* fields above cover only tokens of the trainer's own version).
    mismatch_by_staleness: dict[str, MismatchFigures] = msgspec.field(default_factory=dict)
    # The train/inference mismatch of every sampled token of the step's batch, each scored
    # under the weights of the version that generated it (libs.trainer.version_ring), by its
    # version gap to the trainer: "0", "1", "2", "3+" and "all"; empty on steps not measured
    # (trainer.mismatch_exact_every_steps). The tokens left out: their version no longer kept.
    mismatch_exact: dict[str, MismatchFigures] = msgspec.field(default_factory=dict)
    mismatch_exact_unscored: int = 0
    # The staleness bound this step's samples were split by (None: records before it was).
    max_staleness: int | None = None
    # The pacer's decision after this step (None: pacing off, or an online step).
    pacing: PacingDecision | None = None
    # The trained episodes' tool use and length (libs.rollout.figures; None: online steps,
    # records before these were, or no tool call attempted for the validity).
    tool_call_validity: float | None = None
    turns_per_episode: float | None = None
    segments_per_episode: float | None = None


class StepSamples(msgspec.Struct, kw_only=True):
    """Which samples one step trained on, dropped as stale, refused, or skipped."""

    step: int
    segment: int
    stream: str = "offline"
    sample_ids: list[str]
    dropped_ids: list[str]
    # Samples of the step's groups refused and dead-lettered (invalid for the policy, or a
    # sample that made the optimizer step fail): neither trained nor dropped as stale.
    refused_ids: list[str] = msgspec.field(default_factory=list)
    # Fresh samples of the step's groups left out as their rewards were all equal
    # (trainer.zero_variance_groups "skip"): consumed, not trained.
    skipped_ids: list[str] = msgspec.field(default_factory=list)


class EvalRecord(msgspec.Struct, kw_only=True):
    """One eval-gate decision, at the trainer step it was taken."""

    step: int
    time: float
    version: int
    promoted: bool
    candidate_score: float
    serving_version: int | None
    serving_score: float | None
    reason: str


class TranscriptRecord(msgspec.Struct, kw_only=True):
    """One held-out episode of an eval-gate decision, at the trainer step it was taken."""

    step: int
    version: int
    episode: EpisodeText


class StepLog:
    """Writes the step, sample and eval records of a run, feeds Prometheus and the trackers,
    and keeps the recent figures the trainer's health answer shows."""

    def __init__(self, run_dir: Path, tracking: Tracking) -> None:
        self.run_dir = run_dir
        self.tracking = tracking
        (run_dir / STEPS_FILE).parent.mkdir(parents=True, exist_ok=True)
        self.rewards: list[float] = []
        self.recent: list[StepRecord] = []

    def write(self, record: StepRecord, samples: StepSamples) -> None:
        # The ids first: a step whose record exists always has its ids.
        append_line(self.run_dir / STEP_SAMPLES_FILE, samples)
        append_line(self.run_dir / STEPS_FILE, record)
        if record.stream == "offline":  # the learning curve is the offline task's
            self.rewards.append(record.mean_reward)
            self.recent = [*self.recent, record][-RECENT_STEPS:]
        export(record)
        self.tracking.log(step_scalars(record), record.step)

    def write_decision(self, decision: PromotionDecision, step: int) -> None:
        """Record an eval-gate decision taken at trainer step `step`."""
        record = EvalRecord(
            step=step,
            time=decision.decided_at,
            version=decision.version,
            promoted=decision.promoted,
            candidate_score=decision.candidate_score,
            serving_version=decision.serving_version,
            serving_score=decision.serving_score,
            reason=decision.reason,
        )
        append_line(self.run_dir / EVALS_FILE, record)
        self.tracking.log(eval_scalars(record), step)

    def write_transcripts(self, transcripts: list[TranscriptRecord]) -> None:
        """Held-out episodes of an eval-gate decision (`rlpipe report` sets the first
        evaluated version's beside the last's)."""
        for transcript in transcripts:
            append_line(self.run_dir / TRANSCRIPTS_FILE, transcript)

    def health_fields(self, window: int = RECENT_STEPS) -> dict[str, float | None]:
        """Reward of the first and last `window` steps, and the recent steps' figures."""
        return {**self.reward_summary(window), **recent_figures(self.recent)}

    def reward_summary(self, window: int = 10) -> dict[str, float | None]:
        """Mean reward of the first and last `window` steps (None before any step)."""
        if not self.rewards:
            return {"reward_first_10": None, "reward_last_10": None}
        first, last = self.rewards[:window], self.rewards[-window:]
        return {
            "reward_first_10": round(sum(first) / len(first), 4),
            "reward_last_10": round(sum(last) / len(last), 4),
        }

    def close(self) -> None:
        self.tracking.close()


def open_step_log(config: TrainerConfig, run_dir: Path) -> StepLog:
    """The step log of a trainer run, with the trackers its config names (the trainer's
    own fields go to them as the run's parameters: no service address or secret)."""
    from libs.trainer.config import TrainerConfig

    values = config.model_dump(mode="json")
    params = {name: values[name] for name in TrainerConfig.model_fields if name in values}
    return StepLog(run_dir, build_tracking(config.tracking, run_dir, params))


def append_line(path: Path, record: msgspec.Struct) -> None:
    with path.open("ab") as file:
        file.write(msgspec.json.encode(record) + b"\n")


def recent_figures(recent: Sequence[StepRecord]) -> dict[str, float | None]:
    """Mean reward, success, staleness and samples/s over `recent` offline steps."""
    if not recent:
        return {"reward_recent": None, "success_recent": None, "staleness_recent": None}
    successes = [r.success for r in recent if r.success is not None]
    counts = [sum(r.staleness.values()) for r in recent]
    elapsed_s = recent[-1].time - recent[0].time
    samples = sum(r.num_samples for r in recent[1:])  # those trained after the first's time
    figures: dict[str, float | None] = {
        "reward_recent": round(sum(r.mean_reward for r in recent) / len(recent), 4),
        "success_recent": round(sum(successes) / len(successes), 4) if successes else None,
        "staleness_recent": round(
            sum(mean_staleness(r) * n for r, n in zip(recent, counts, strict=True))
            / max(sum(counts), 1),
            3,
        ),
    }
    if elapsed_s > 0:
        figures["samples_per_s_recent"] = round(samples / elapsed_s, 2)
    return figures


def mean_staleness(record: StepRecord) -> float:
    """Mean versions between a sample's policy (trained, skipped or dropped) and the
    trainer's."""
    total = sum(record.staleness.values())
    return sum(int(k) * n for k, n in record.staleness.items()) / total if total else 0.0


def step_scalars(record: StepRecord) -> dict[str, float]:
    """The step's figures as tracker scalars, `group/name`; an online step's reward goes
    under `online/` so the offline learning curve stays one task's."""
    reward = "online" if record.stream == "online" else "reward"
    scalars = {
        f"{reward}/mean": record.mean_reward,
        "train/loss": record.loss,
        "train/grad_norm": record.grad_norm,
        "train/learning_rate": record.learning_rate,
        "train/clip_fraction": record.clip_fraction,
        "train/samples": record.num_samples,
        "train/loss_tokens": record.num_loss_tokens,
        "train/zero_variance_groups": record.num_zero_variance_groups,
        "train/skipped_groups": record.num_skipped_groups,
        "train/policy_version": record.version,
        "staleness/mean": mean_staleness(record),
        "staleness/max": max((int(k) for k in record.staleness), default=0),
        "staleness/dropped": record.num_dropped,
        "mismatch/mean_abs": record.mismatch_mean_abs,
        "mismatch/kl": record.mismatch_kl,
        "importance/weight_mean": record.is_weight_mean,
        "importance/weight_max": record.is_weight_max,
        "importance/truncated_fraction": record.is_truncated_fraction,
        "throughput/samples_per_s": record.samples_per_s,
        "throughput/tokens_per_s": record.tokens_per_s,
        "time/step_s": record.step_s,
        "time/wait_s": record.wait_s,
        "time/wait_weights_s": record.wait_weights_s,
        "time/busy_fraction": record.busy_fraction,
    }
    if record.success is not None:
        scalars[f"{reward}/success"] = record.success
    if record.routing_disagreement is not None:
        scalars["routing/disagreement"] = record.routing_disagreement
    for bucket, figures in record.mismatch_by_staleness.items():
        name = bucket.replace("+", "_plus")  # MLflow refuses "+" in a metric name
        scalars[f"off_policy/kl_{name}"] = figures.kl
        scalars[f"off_policy/outside_{name}"] = figures.is_outside_fraction
        scalars[f"off_policy/weight_mean_{name}"] = figures.is_weight_mean
    for bucket, figures in record.mismatch_exact.items():
        name = bucket.replace("+", "_plus")
        scalars[f"mismatch_exact/mean_abs_{name}"] = figures.mean_abs
        scalars[f"mismatch_exact/kl_{name}"] = figures.kl
    if record.mismatch_exact:
        scalars["mismatch_exact/unscored_tokens"] = record.mismatch_exact_unscored
    if record.max_staleness is not None:
        scalars["staleness/bound"] = record.max_staleness
    if record.stream == "online":
        scalars["online/mean_advantage"] = record.online_mean_advantage
        scalars["online/invalid"] = record.num_online_invalid
    return {name: float(value) for name, value in scalars.items()}


def eval_scalars(record: EvalRecord) -> dict[str, float]:
    """An eval-gate decision as tracker scalars."""
    scalars = {
        "eval/candidate_score": record.candidate_score,
        "eval/promoted": float(record.promoted),
        "eval/candidate_version": float(record.version),
    }
    if record.serving_version is not None and record.serving_score is not None:
        scalars["eval/serving_version"] = float(record.serving_version)
        scalars["eval/serving_score"] = record.serving_score
    return scalars


T = TypeVar("T", bound=msgspec.Struct)


def read_records(path: Path, kind: type[T]) -> list[T]:
    """The records of a JSON-lines file; a last line still being written is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            records.append(msgspec.json.decode(line, type=kind))
        except msgspec.DecodeError:
            break
    return records


def read_steps(run_dir: Path) -> list[StepRecord]:
    """Every step record of the run, in the order written (resumed steps appear twice)."""
    return read_records(run_dir / STEPS_FILE, StepRecord)


def read_step_samples(run_dir: Path) -> list[StepSamples]:
    """Every step's sample ids, in the order written (resumed steps appear twice)."""
    return read_records(run_dir / STEP_SAMPLES_FILE, StepSamples)


def read_evals(run_dir: Path) -> list[EvalRecord]:
    return read_records(run_dir / EVALS_FILE, EvalRecord)


def read_transcripts(run_dir: Path) -> list[TranscriptRecord]:
    return read_records(run_dir / TRANSCRIPTS_FILE, TranscriptRecord)


R = TypeVar("R", StepRecord, StepSamples)


def latest_per_step(records: Sequence[R]) -> list[R]:
    """For each step, the record of the latest segment, in step order: a resumed
    trainer redoes the steps after its checkpoint, superseding the first run's records."""
    latest: dict[int, R] = {}
    for record in records:
        if record.step not in latest or record.segment >= latest[record.step].segment:
            latest[record.step] = record
    return [latest[step] for step in sorted(latest)]


def export(record: StepRecord) -> None:
    """Set the Prometheus series from one record."""
    STEP.set(record.step)
    VERSION.set(record.version)
    if record.stream == "online":
        export_online(record)
    else:
        REWARD.set(record.mean_reward)
    for staleness, count in record.staleness.items():
        for _ in range(count):
            STALENESS.observe(staleness)
    DROPPED.inc(record.num_dropped)
    SKIPPED_GROUPS.inc(record.num_skipped_groups)
    MISMATCH.set(record.mismatch_mean_abs)
    MISMATCH_KL.set(record.mismatch_kl)
    if record.routing_disagreement is not None:
        ROUTING_DISAGREEMENT.set(record.routing_disagreement)
    for bucket, figures in record.mismatch_by_staleness.items():
        OFF_POLICY_KL.labels(bucket).set(figures.kl)
        OFF_POLICY_OUTSIDE.labels(bucket).set(figures.is_outside_fraction)
    for bucket, figures in record.mismatch_exact.items():
        EXACT_MISMATCH.labels(bucket).set(figures.mean_abs)
        EXACT_MISMATCH_KL.labels(bucket).set(figures.kl)
    if record.max_staleness is not None:
        STALENESS_BOUND.set(record.max_staleness)
    CLIP.set(record.clip_fraction)
    IS_WEIGHT.set(record.is_weight_mean)
    TOKENS_PER_S.set(record.tokens_per_s)
    BUSY.set(record.busy_fraction)
    LEARNING_RATE.set(record.learning_rate)
    STEP_SECONDS.observe(record.step_s)


def export_online(record: StepRecord) -> None:
    """The online series of an online step's record."""
    ONLINE_REWARD.set(record.mean_reward)
    ONLINE_SAMPLES.inc(record.num_samples)
    ONLINE_DROPPED.labels("stale").inc(record.num_dropped)
    ONLINE_DROPPED.labels("invalid").inc(record.num_online_invalid)
    for kind, value in record.online_baselines.items():
        ONLINE_BASELINE.labels(kind).set(value)
