"""One optimizer step on online samples (product feedback): tensors in, statistics out.

    advantages  <- reward (signal mapping) - running baseline of the sample's context kind
    batch       <- prompt + completion ids, completion tokens trained, served logprobs
    proximal    <- the trainer's logprobs before the update (no grad)
    loss        <- libs.rl.loss PPO-clip with truncated importance weights, per minibatch
    step        <- AdamW on each minibatch

The objective is critic-free policy gradient for single samples: with one minibatch the
ratio to the proximal policy is 1 and the gradient is w * (reward - baseline) * grad log p,
w = min(exp(trainer - served), cap) correcting for the served version being behind.
`baselines` is updated in place (it belongs to the trainer's checkpointed state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import PreTrainedModel

from libs.rl import MismatchStats, PolicyLossStats
from libs.rl.online import (
    DEFAULT_CONTEXT_KEY,
    DEFAULT_SIGNAL_REWARDS,
    OnlineBaselines,
    build_online_batch,
    check_signal_rewards,
    online_advantages,
)
from libs.trainer.step import StepConfig, optimize_on_batch
from proto.messages import OnlineSample


class OnlineConfig(BaseModel):
    """Whether and how online samples (product feedback) become a training signal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float = Field(
        0.0, ge=0, le=1, description="Share of steps on online samples (0: off, 1: online only)"
    )
    stream_wait_s: float = Field(
        5.0, ge=0, description="Wait for a step's scheduled stream before taking the other"
    )
    batch_samples: int = Field(32, ge=1, description="Most online samples per step")
    # Online steps use this fraction of the trainer's learning rate: one step holds a few
    # single samples (no group), so at the offline rate one accepted completion moved its
    # logprob by +6.3 nats in the end-to-end test (the tiny policy, lr 5e-4).
    learning_rate_scale: float = Field(
        0.1, gt=0, le=1, description="Online steps' learning rate as a fraction of the trainer's"
    )
    signal_rewards: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_SIGNAL_REWARDS),
        description="Reward of each feedback signal (JSON object; every signal must be named)",
    )
    max_staleness: int = Field(
        8, ge=0, description="Online samples served more than this many versions ago are dropped"
    )
    baseline_decay: float = Field(
        0.9, ge=0, lt=1, description="EMA decay of the per-context-kind reward baseline"
    )
    context_key: str = Field(
        DEFAULT_CONTEXT_KEY, description="Generation metadata key that names the context kind"
    )

    @field_validator("signal_rewards")
    @classmethod
    def _every_signal_has_a_reward(cls, value: dict[str, float]) -> dict[str, float]:
        return check_signal_rewards(value)


@dataclass(frozen=True)
class OnlineStepStats:
    """What one online step did, for metrics."""

    loss: float
    num_samples: int
    num_loss_tokens: int
    grad_norm: float
    mean_reward: float
    mean_advantage: float
    baselines: dict[str, float]  # per context kind in the batch, after the step's updates
    policy: PolicyLossStats
    mismatch: MismatchStats
    routing_disagreement: float | None = None  # MoE samples carrying routing (router_replay)


def train_online_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    samples: list[OnlineSample],
    baselines: OnlineBaselines,
    trainer_version: int,
    step: StepConfig,
    online: OnlineConfig,
    pad_id: int,
) -> OnlineStepStats:
    """Update `model` in place on `samples` (fresh enough, trainable); returns statistics."""
    device = next(model.parameters()).device
    scored = online_advantages(
        samples,
        online.signal_rewards,
        baselines,
        decay=online.baseline_decay,
        context_key=online.context_key,
    )
    batch = build_online_batch(
        samples, scored.advantages, pad_id=pad_id, max_length=step.max_sequence_tokens
    ).to(device)
    update = optimize_on_batch(model, optimizer, batch, trainer_version, step)
    return OnlineStepStats(
        loss=update.loss,
        num_samples=len(samples),
        num_loss_tokens=batch.num_loss_tokens,
        grad_norm=update.grad_norm,
        mean_reward=scored.mean_reward,
        mean_advantage=float(scored.advantages.mean()),
        baselines={kind: baselines.value(kind) for kind in sorted(set(scored.kinds))},
        policy=update.policy,
        mismatch=update.mismatch,
        routing_disagreement=update.routing_disagreement,
    )
