"""The learning math of the trainer: pure functions from tensors to tensors.

    advantages   GRPO group advantages (centered, optional std normalization)
    staleness    a sample's policy version, staleness split and histogram
    batch        scored rollouts -> padded tensors and masks for one forward pass
    loss         PPO-clip with truncated or masked importance weights (token or sample mean),
                 its stats; the KL anchor to a reference policy
    mismatch     behavior-vs-trainer mismatch (KL, importance-weight spread) per staleness

Each is tested on CPU against hand-computed references in tests/test_rl_math.py.
"""

from libs.rl.advantages import (
    GroupAdvantages,
    group_advantages,
    group_index,
    has_reward_variance,
)
from libs.rl.batch import NO_VERSION, TrainBatch, build_batch
from libs.rl.loss import (
    LossAggregation,
    OffPolicyCorrection,
    PolicyLossStats,
    ppo_clip_loss,
    reference_kl,
    sample_mean_scale,
)
from libs.rl.mismatch import (
    MismatchStats,
    merge_mismatch,
    mismatch_by_staleness,
    mismatch_stats,
    same_version_mask,
    staleness_buckets,
    token_staleness,
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
    "OffPolicyCorrection",
    "PolicyLossStats",
    "StalenessSplit",
    "TrainBatch",
    "build_batch",
    "group_advantages",
    "group_index",
    "has_reward_variance",
    "merge_mismatch",
    "mismatch_by_staleness",
    "mismatch_stats",
    "ppo_clip_loss",
    "reference_kl",
    "same_version_mask",
    "sample_mean_scale",
    "sample_policy_version",
    "sample_staleness",
    "split_by_staleness",
    "staleness_buckets",
    "staleness_histogram",
    "token_staleness",
    "turn_trainable",
]
