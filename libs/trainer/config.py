"""What the trainer trains and how: one pydantic model, the trainer service's settings as is.

    config = TrainerConfig(policy=PolicyConfig(path="models/mine"), learning_rate=1e-5)
    config = config.sized_for(num_parameters)   # learning rate, staleness unset: by size
    trainer = Trainer(config, run_dir, bus, publisher)

`TrainerSettings` (services/trainer) is this model plus the service's own fields, read from
`RLPIPE_TRAINER_*` variables: the objective's knobs (`StepConfig`) are top-level fields
(`RLPIPE_TRAINER_CLIP_EPS_LOW`), the nested parts have their own prefix
(`RLPIPE_TRAINER_POLICY_PATH`, `RLPIPE_TRAINER_ONLINE_FRACTION`,
`RLPIPE_TRAINER_EVAL_EVERY_VERSIONS`, `RLPIPE_TRAINER_TRACKING_BACKENDS`). Every field and
default is declared here once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libs.policy import PolicyConfig
from libs.tracking import TrackingConfig
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.online_step import OnlineConfig
from libs.trainer.pacing import PacingConfig
from libs.trainer.precision import MasterWeights
from libs.trainer.step import StepConfig
from libs.weights.same_host import SameHostShareConfig

WeightHandover = Literal["auto", "state", "delta"]


class TrainerConfig(StepConfig):
    """The trainer loop's configuration: the policy, the objective, the schedule."""

    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The policy trained")
    learning_rate: float | None = Field(
        None, gt=0, description="AdamW learning rate; unset: by model size (default_learning_rate)"
    )
    master_weights: MasterWeights = Field(
        "fp32",
        description="fp32: fp32 weights and AdamW state, compute in the policy dtype; "
        "policy: all in the policy dtype (libs/trainer/precision.py)",
    )
    # With a constant rate the tiny default policy, once nearly deterministic, drifted off the
    # learned task (0.99 at step 400, 0.44 at step 625); with a decay over 400 steps it held
    # 0.99 to step 700 (one run each, 2-core CPU).
    learning_rate_decay_steps: int | None = Field(
        400, ge=1, description="Steps over which the learning rate decays linearly (None: constant)"
    )
    min_learning_rate_ratio: float = Field(
        0.1, gt=0, le=1, description="Learning rate at the end of the decay, as a fraction"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    rank_layout: Literal["auto", "replicate", "shard"] = Field(
        "auto",
        description="Trainer ranks: each holds the whole policy and AdamW state and the "
        "gradients are summed (replicate), or each holds 1/N of them (shard, FSDP2); auto: "
        "replicate on GPUs while weights, gradients and AdamW state fit a quarter of one "
        "card, shard otherwise and on CPUs (libs/trainer/sharded.py)",
    )
    rank_reshard_after_forward: bool | None = Field(
        None,
        description="Trainer ranks: free each layer's gathered weights after its forward and "
        "gather them again for the backward (FSDP2), or keep them to the backward; unset: by "
        "size (kept while the whole model fits a quarter of one card: libs/trainer/sharded.py)",
    )
    batch_groups: int = Field(16, ge=1, description="GRPO groups per optimizer step")
    # A group whose samples all got the same reward has advantage 0 on every sample: no
    # policy gradient, yet it takes a batch slot and dilutes the token mean of the loss.
    zero_variance_groups: Literal["train", "skip"] = Field(
        "train",
        description="Groups whose fresh samples all got the same reward: train: they fill "
        "the batch like any group (advantage 0, counted in num_zero_variance_groups); skip: "
        "they are consumed without training, counted in num_skipped_groups, and the step "
        "waits for batch_groups groups whose rewards differ (DAPO's dynamic sampling; "
        "groups of size 1 still train; needs feeder.mode async: sync feeds no tasks "
        "for skipped groups)",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Samples older than this many versions are dropped (0: synchronous); "
        "unset: by model size (default_max_staleness); with pacing on, where the bound starts",
    )
    mismatch_exact_every_steps: int | None = Field(
        None,
        ge=0,
        description="Every N offline steps, score each sampled token under the weights of the "
        "version that generated it: the train/inference mismatch on every token, by version "
        "gap (one no-grad forward of the batch more on each step measured, "
        "libs/trainer/version_ring.py); 0: off; unset: 4 with one rank, off with N ranks "
        "(not supported there)",
    )
    mismatch_versions_kept: int | None = Field(
        None,
        ge=1,
        description="Versions whose weights the trainer keeps for that, in host memory (each "
        "the size of the master weights); unset: the staleness bound + 1 (the pacer's "
        "highest with pacing on); older tokens are counted as not scored",
    )
    pacing: PacingConfig = Field(
        default_factory=PacingConfig,
        description="The staleness bound moved by the measured mismatch (libs/trainer/pacing.py)",
    )
    # A crash drops what workers generated on the steps since the last checkpoint once those
    # are past max_staleness; a checkpoint of the tiny policy costs milliseconds, in a thread.
    checkpoint_every_steps: int = Field(4, ge=1, description="Steps between checkpoints")
    # Written in line, a large model's checkpoint stalls the trainer seconds; in the background
    # the step waits only for a copy into host buffers kept for the next one (host_memory.py).
    checkpoint_in_background: bool = Field(
        True,
        description="Write checkpoints beside training from a copy in host memory (holds "
        "that much host memory, the size of the weights and optimizer state); off: in line",
    )
    checkpoint_keep: int = Field(
        2,
        ge=1,
        description="Newest checkpoints kept; those of the promoted and best-eval versions "
        "are kept besides",
    )
    # More than 1 for big models whose versions take longer to ship than to train.
    publish_every_steps: int = Field(
        1, ge=1, description="Stage weights for the broadcaster every N steps (sync mode: 1)"
    )
    # Staged whole, a large model's version is written, read back and diffed even when few changed.
    weight_handover: WeightHandover = Field(
        "auto",
        description="How versions reach the weight-broadcaster: state (each whole, it "
        "encodes the delta), delta (the trainer encodes each after the first against the "
        "one before, on its device, in a process of its own: holds one more copy of the "
        "published weights on the device and two in pinned host memory, "
        "libs/trainer/staging.py), auto (delta where the policy is on a GPU)",
    )
    handover_threads: int = Field(
        8, ge=1, description="Threads hashing and compressing the deltas the trainer encodes"
    )
    same_host: SameHostShareConfig = Field(
        default_factory=SameHostShareConfig,
        description="Versions shared in memory with this host's workers "
        "(libs/weights/same_host.py)",
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps")
    incomplete_group_timeout_s: float = Field(
        120.0, gt=0, description="Train a group with missing samples after this long"
    )
    online: OnlineConfig = Field(
        default_factory=OnlineConfig, description="Training on product feedback"
    )
    eval: EvalGateConfig = Field(
        default_factory=EvalGateConfig, description="The eval gate promoting versions to serving"
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment trackers the step metrics go to (TensorBoard, W&B, MLflow)",
    )

    def sized_for(self, num_parameters: int) -> TrainerConfig:
        """This config with the fields left unset (learning rate, staleness bound) set to
        the defaults for a model of `num_parameters`."""
        update: dict[str, float | int] = {}
        if self.learning_rate is None:
            update["learning_rate"] = default_learning_rate(num_parameters)
        if self.max_staleness is None:
            update["max_staleness"] = default_max_staleness(num_parameters)
        return self.model_copy(update=update) if update else self


# The fastest to learn the demo task per model size (bench/results/h200/learning.json).
SMALL_MODEL_PARAMETERS = 50_000_000
SMALL_MODEL_LEARNING_RATE = 5e-4
LARGE_MODEL_LEARNING_RATE = 1e-5
# A large model's version takes seconds to reach the workers, so its samples arrive more
# versions old: the trainer waits less at 8 (it waits whenever it is max_staleness - 1 ahead).
SMALL_MODEL_MAX_STALENESS = 4
LARGE_MODEL_MAX_STALENESS = 8


def default_learning_rate(num_parameters: int) -> float:
    """The learning rate a model of `num_parameters` trains at unless one is configured."""
    if num_parameters < SMALL_MODEL_PARAMETERS:
        return SMALL_MODEL_LEARNING_RATE
    return LARGE_MODEL_LEARNING_RATE


def default_max_staleness(num_parameters: int) -> int:
    """The staleness bound for a model of `num_parameters` unless one is configured."""
    if num_parameters < SMALL_MODEL_PARAMETERS:
        return SMALL_MODEL_MAX_STALENESS
    return LARGE_MODEL_MAX_STALENESS
