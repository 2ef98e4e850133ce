"""The policy loss: token-level PPO-clip with decoupled off-policy correction (AReaL-style).

Three policies meet here, each as logprobs [B, T-1] of the sampled tokens:
- behavior: the inference engine's, recorded with each sampled token (any older version);
- proximal: the trainer's parameters at the start of this step, recomputed, no grad;
- new: the parameters being optimized, with grad.

Per token, with w = min(exp(proximal - behavior), is_cap) (detached) and
r = exp(new - proximal):

    objective = w * min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)
    loss = -sum(objective over loss tokens) / number of loss tokens    (DAPO token mean)

or, with `sample_mean_scale` applied to the advantages, the mean over samples of each
sample's own token mean (GRPO's original weighting: a long sample weighs as much as a short
one, not as much as all the short ones together).

The importance weight w corrects for the samples coming from an older (or numerically
different) policy; the clip keeps each step near the proximal policy, whatever the
behavior policy was. Two corrections (`correction`):
- "truncate": w = min(exp(proximal - behavior), is_cap), as above (truncated IS);
- "mask": w = exp(proximal - behavior) inside [1/is_cap, is_cap], else 0 (IcePop-style
  token masking): a token the two policies disagree on too much in either direction gives no
  gradient at all, where truncation still pushes it with weight is_cap (or a tiny weight
  that keeps its bias). Stale samples make such tokens more frequent.
The mismatch metrics (libs.rl.mismatch) compare proximal and behavior logprobs.

An optional anchor keeps the policy near a fourth one, the reference (the weights training
started from, e.g. an SFT warm start), over the whole run, not only within a step:

    loss += kl_coef * reference_kl(new, reference, mask)    # k3 estimate of KL(new || ref)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from libs.rl.mismatch import MismatchStats, mismatch_stats


@dataclass(frozen=True)
class PolicyLossStats:
    """What the trainer reports about one loss evaluation; zeros when no token is masked in."""

    num_tokens: int
    clip_fraction: float
    """Fraction of loss tokens whose gradient the clip removed (r left the band against A)."""
    is_weight_mean: float
    """Mean/max/min of the applied (truncated) importance weight over loss tokens."""
    is_weight_max: float
    is_weight_min: float
    is_truncated_fraction: float
    """Fraction of loss tokens whose weight the correction changed: raw weight above
    `is_cap` (truncate), or outside [1/is_cap, is_cap] and so masked (mask)."""
    mismatch: MismatchStats


# exp() of a log-ratio beyond this overflows float32 gradients long before it means anything.
MAX_REFERENCE_LOG_RATIO = 20.0


def reference_kl(
    new_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_tokens_total: int | None = None,
) -> torch.Tensor:
    """Token mean over `loss_mask` of the k3 estimate of KL(new || reference); shapes [B, T-1].

    Per token, with d = reference - new: exp(d) - d - 1 (>= 0, zero where they agree; its
    gradient pulls `new` toward `reference`; unbiased for the KL on tokens sampled from the
    new policy, as GRPO uses it). `num_tokens_total` as in `ppo_clip_loss`.
    """
    mask = loss_mask.bool()
    log_ratio = torch.where(
        mask,
        reference_logprobs.detach().float() - new_logprobs.float(),
        torch.zeros_like(mask, dtype=torch.float32),
    ).clamp(-MAX_REFERENCE_LOG_RATIO, MAX_REFERENCE_LOG_RATIO)
    k3 = torch.expm1(log_ratio) - log_ratio
    count = int(mask.sum().item()) if num_tokens_total is None else num_tokens_total
    return torch.where(mask, k3, torch.zeros_like(k3)).sum() / max(count, 1)


LossAggregation = Literal["token_mean", "sample_mean"]
OffPolicyCorrection = Literal["truncate", "mask"]


def sample_mean_scale(
    loss_mask: torch.Tensor, num_tokens_total: int, num_rows_total: int
) -> torch.Tensor:
    """[B] factors that turn the token mean into a sample mean when they scale `advantages`.

    The objective is positively homogeneous in the advantage (min(r*cA, clip(r)*cA) = c *
    min(r*A, clip(r)*A) for c > 0), so scaling row b's advantage by N / (R * L_b), with N the
    loss tokens and R the rows of the whole (mini)batch and L_b the row's own loss tokens,
    gives -(1/R) sum_b (1/L_b) sum_t objective: each sample weighs 1/R. A row without loss
    tokens gets 0.
    """
    lengths = loss_mask.float().sum(dim=-1)
    scale = num_tokens_total / (max(num_rows_total, 1) * lengths.clamp(min=1.0))
    return torch.where(lengths > 0, scale, torch.zeros_like(scale))


def ppo_clip_loss(
    new_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    is_cap: float = 2.0,
    correction: OffPolicyCorrection = "truncate",
    mismatch_mask: torch.Tensor | None = None,
    num_tokens_total: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Scalar loss (to minimize) and its stats; shapes [B, T-1] except `advantages` [B].

    `mismatch_mask` selects the tokens for the mismatch metric (see `same_version_mask`);
    None reports no mismatch (count 0). `num_tokens_total` replaces this call's loss-token
    count as the denominator: pass the whole step's count when accumulating gradients over
    micro-batches, so the result equals one token mean over the step.
    """
    if is_cap < 1.0:
        raise ValueError(
            f"is_cap must be >= 1 (a cap below 1 down-weights on-policy tokens), got {is_cap}"
        )
    mask = loss_mask.bool()
    proximal = proximal_logprobs.detach().float()
    weight, truncated = _importance_weights(proximal, behavior_logprobs, mask, is_cap, correction)
    # Off the mask, every input may be padding garbage; `where` (not a multiply) keeps a
    # non-finite value there out of both the loss and its gradient.
    ratio = torch.where(mask, new_logprobs.float() - proximal, torch.zeros_like(proximal)).exp()
    adv = advantages.detach().float().unsqueeze(-1).expand_as(ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    objective = weight * torch.minimum(ratio * adv, clipped_ratio * adv)
    num_tokens = int(mask.sum().item())
    denominator = max(num_tokens if num_tokens_total is None else num_tokens_total, 1)
    loss = -torch.where(mask, objective, torch.zeros_like(objective)).sum() / denominator
    # The clip removes the gradient only where r left the band in the advantage's direction.
    clipped = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | (
        (adv < 0) & (ratio < 1.0 - clip_eps_low)
    )
    if mismatch_mask is None:
        mismatch_mask = torch.zeros_like(mask)
    mismatch = mismatch_stats(proximal, behavior_logprobs, mismatch_mask)
    return loss, _loss_stats(mask, num_tokens, clipped, weight, truncated, mismatch)


def _importance_weights(
    proximal: torch.Tensor,
    behavior: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    correction: OffPolicyCorrection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(applied weight, changed by the correction), both [B, T-1]; weight 1 off `mask`.
    truncate: min(w, cap), changed where w > cap; mask: w, or 0 where w leaves [1/cap, cap]."""
    log_weight = torch.where(mask, proximal - behavior.detach().float(), torch.zeros_like(proximal))
    raw_weight = log_weight.exp()
    if correction == "truncate":
        return raw_weight.clamp(max=cap), raw_weight > cap
    if correction == "mask":
        outside = (raw_weight > cap) | (raw_weight < 1.0 / cap)
        return torch.where(outside, torch.zeros_like(raw_weight), raw_weight), outside
    raise ValueError(f"correction must be 'truncate' or 'mask', got {correction!r}")


def _loss_stats(
    mask: torch.Tensor,
    num_tokens: int,
    clipped: torch.Tensor,
    weight: torch.Tensor,
    truncated: torch.Tensor,
    mismatch: MismatchStats,
) -> PolicyLossStats:
    """Clip and importance-weight statistics over the `mask`ed tokens, in one device sync."""
    if num_tokens == 0:
        return PolicyLossStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, mismatch)
    selected = weight.detach()[mask]
    values = torch.stack(
        [
            clipped[mask].float().mean(),
            selected.mean(),
            selected.max(),
            selected.min(),
            truncated[mask].float().mean(),
        ]
    ).tolist()
    clip_fraction, weight_mean, weight_max, weight_min, truncated_fraction = values
    return PolicyLossStats(
        num_tokens=num_tokens,
        clip_fraction=clip_fraction,
        is_weight_mean=weight_mean,
        is_weight_max=weight_max,
        is_weight_min=weight_min,
        is_truncated_fraction=truncated_fraction,
        mismatch=mismatch,
    )
