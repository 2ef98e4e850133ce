"""The reference policy: a frozen copy of the weights training started from, for the KL anchor.

    reference = setup_reference(config)          # None when config.kl_coef == 0
    ref = reference.logprobs(input_ids, mask)    # [B, T-1], no grad

RL from a fine-tuned start (an SFT warm start, a user's instruct model) must sharpen that
policy without forgetting it. PPO's clip bounds each step only against the weights of that
step; over many small-batch steps the policy can still drift far (on the 2-core demo,
calc's warm start lost its tool calls in 8 steps at lr 5e-4). With `kl_coef > 0` the step's
loss adds `kl_coef * KL(new || reference)` (libs.rl.reference_kl), with the reference built
from the policy the trainer was configured with (`policy.path`), never from a checkpoint:
a resumed run keeps the anchor it started with. It costs one more forward per step and one
more copy of the weights.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from libs.policy import PolicyConfig, build_policy, sequence_logprobs


class ReferencePolicy:
    """A frozen model whose token logprobs anchor the trained policy."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)

    @classmethod
    def build(cls, policy: PolicyConfig) -> ReferencePolicy:
        return cls(build_policy(policy))

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T-1] logprobs of each next token under the reference weights."""
        with torch.no_grad():
            return sequence_logprobs(self.model, input_ids, attention_mask)


def setup_reference(kl_coef: float, policy: PolicyConfig) -> ReferencePolicy | None:
    """The reference of a trainer configured with `kl_coef` and `policy`; None without anchor."""
    return ReferencePolicy.build(policy) if kl_coef > 0 else None
