"""Per-step trainer metrics: one record per step as a JSON line, Prometheus, and a log line.

The JSON lines (`<run>/trainer/steps.jsonl`) are the run's history: reward, staleness,
mismatch, importance weights, throughput, and which samples each step trained on or dropped
(so a resumed run can be checked for lost or repeated samples).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from prometheus_client import Counter, Gauge, Histogram

STEP = Gauge("rlpipe_trainer_step", "Optimizer steps taken")
VERSION = Gauge("rlpipe_trainer_policy_version", "Policy version the trainer holds")
REWARD = Gauge("rlpipe_trainer_mean_reward", "Mean reward of the last step's samples")
STALENESS = Histogram(
    "rlpipe_trainer_sample_staleness_versions",
    "Versions between a sample's policy and the trainer's, at training time",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
DROPPED = Counter("rlpipe_trainer_dropped_samples_total", "Samples dropped as too stale")
MISMATCH = Gauge(
    "rlpipe_trainer_logprob_mismatch_nats", "Mean |trainer - inference| logprob, same version"
)
MISMATCH_KL = Gauge("rlpipe_trainer_mismatch_kl_nats", "k3 KL(inference || trainer), same version")
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


class StepRecord(msgspec.Struct, kw_only=True):
    """Everything the trainer reports about one step."""

    step: int
    version: int
    segment: int
    time: float
    mean_reward: float
    num_samples: int
    # Training rows: one per sample, one per context segment of a self-summarizing episode.
    num_rows: int = 0
    num_groups: int
    num_zero_variance_groups: int
    num_loss_tokens: int
    loss: float
    grad_norm: float
    staleness: dict[int, int]
    num_dropped: int
    mismatch_tokens: int
    mismatch_mean_abs: float
    mismatch_kl: float
    clip_fraction: float
    is_weight_mean: float
    is_weight_max: float
    is_truncated_fraction: float
    step_s: float
    wait_s: float
    tokens_per_s: float
    samples_per_s: float
    busy_fraction: float
    sample_ids: list[str]
    dropped_ids: list[str]
    # Samples of the step's groups refused and dead-lettered (invalid for the policy, or a
    # sample that made the optimizer step fail): neither trained nor dropped as stale.
    refused_ids: list[str] = msgspec.field(default_factory=list)
    # Which stream the step trained on: "offline" (scored GRPO groups) or "online" (product
    # feedback). For an online step the fields above describe its online samples
    # (mean_reward: the mean mapped reward; num_groups 0), and these add the rest.
    stream: str = "offline"
    num_online_invalid: int = 0
    online_mean_advantage: float = 0.0
    # Running baseline of each context kind in the step, after the step's updates.
    online_baselines: dict[str, float] = msgspec.field(default_factory=dict)


class StepLog:
    """Appends step records to a JSON-lines file and keeps the reward history."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rewards: list[float] = []

    def write(self, record: StepRecord) -> None:
        with self.path.open("ab") as file:
            file.write(msgspec.json.encode(record) + b"\n")
        if record.stream == "offline":  # the learning curve is the offline task's
            self.rewards.append(record.mean_reward)
        export(record)

    def reward_summary(self, window: int = 10) -> dict[str, float | None]:
        """Mean reward of the first and last `window` steps (None before any step)."""
        if not self.rewards:
            return {"reward_first_10": None, "reward_last_10": None}
        first, last = self.rewards[:window], self.rewards[-window:]
        return {
            "reward_first_10": round(sum(first) / len(first), 4),
            "reward_last_10": round(sum(last) / len(last), 4),
        }


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
    MISMATCH.set(record.mismatch_mean_abs)
    MISMATCH_KL.set(record.mismatch_kl)
    CLIP.set(record.clip_fraction)
    IS_WEIGHT.set(record.is_weight_mean)
    TOKENS_PER_S.set(record.tokens_per_s)
    BUSY.set(record.busy_fraction)
    STEP_SECONDS.observe(record.step_s)


def export_online(record: StepRecord) -> None:
    """The online series of an online step's record."""
    ONLINE_REWARD.set(record.mean_reward)
    ONLINE_SAMPLES.inc(record.num_samples)
    ONLINE_DROPPED.labels("stale").inc(record.num_dropped)
    ONLINE_DROPPED.labels("invalid").inc(record.num_online_invalid)
    for kind, value in record.online_baselines.items():
        ONLINE_BASELINE.labels(kind).set(value)
