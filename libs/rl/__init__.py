"""The learning math of the trainer: pure functions from tensors to tensors.

    advantages   GRPO group advantages (centered, optional std normalization)
    staleness    a sample's policy version, staleness split and histogram
    batch        scored rollouts -> padded tensors and masks for one forward pass
    loss         PPO-clip with truncated importance weights (token or sample mean), its stats;
                 the KL anchor to a reference policy

Each is tested on CPU against hand-computed references in tests/test_rl_math.py.
"""

from libs.rl.advantages import GroupAdvantages, group_advantages, group_index
from libs.rl.batch import NO_VERSION, TrainBatch, build_batch
from libs.rl.loss import (
    LossAggregation,
    MismatchStats,
    PolicyLossStats,
    mismatch_stats,
    ppo_clip_loss,
    reference_kl,
    same_version_mask,
    sample_mean_scale,
)
from libs.rl.staleness import (
    StalenessSplit,
    sample_policy_version,
    sample_staleness,
    split_by_staleness,
    staleness_histogram,
    turn_trainable,
)

__all__ = [
    "NO_VERSION",
    "GroupAdvantages",
    "LossAggregation",
    "MismatchStats",
    "PolicyLossStats",
    "StalenessSplit",
    "TrainBatch",
    "build_batch",
    "group_advantages",
    "group_index",
    "mismatch_stats",
    "ppo_clip_loss",
    "reference_kl",
    "same_version_mask",
    "sample_mean_scale",
    "sample_policy_version",
    "sample_staleness",
    "split_by_staleness",
    "staleness_histogram",
    "turn_trainable",
]
