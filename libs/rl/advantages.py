"""GRPO advantages: each sample's reward relative to the other samples of its group.

    index = group_index([r.rollout.group_id for r in batch])    # [N] dense group numbers
    result = group_advantages(rewards, index, normalize_std=True)
    result.advantages                  # [N], in input order
    result.num_zero_variance_groups    # groups whose samples all got the same reward
    has_reward_variance([1.0, 1.0, 1.0])   # False: one group's rewards, all equal

A group whose rewards are all equal teaches nothing relative to itself: its samples get an
advantage of exactly 0 (also with normalization, where 0/eps would otherwise amplify noise),
and the group is counted so the trainer can report it (or leave it out of the batch:
trainer.zero_variance_groups).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# Rewards of a group spanning at most this much are equal: the group is a zero-variance group.
ZERO_RANGE_TOL = 1e-6


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-sample advantages and what the trainer reports about the groups."""

    advantages: torch.Tensor
    """[N] float32, in the order of the input rewards."""
    zero_variance: torch.Tensor
    """[N] bool, True for samples of a zero-variance group (their advantage is 0)."""
    num_groups: int
    num_zero_variance_groups: int


def group_index(keys: Sequence[Hashable]) -> torch.Tensor:
    """Dense group numbers [N] (long) for group keys such as `Rollout.group_id`.

    Groups are numbered in order of first appearance: ["b", "a", "b"] -> [0, 1, 0].
    """
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(key, len(numbers)) for key in keys], dtype=torch.long)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    normalize_std: bool = False,
    std_eps: float = 1e-6,
    zero_range_tol: float = ZERO_RANGE_TOL,
) -> GroupAdvantages:
    """Advantages [N] of `rewards` [N] within the groups `group_ids` [N] (ints >= 0).

    advantage = reward - group mean, divided by (group std + `std_eps`) when `normalize_std`.
    The std is the population std (divides by the group size), so a normalized group has
    unit spread whatever its size. A group whose rewards span at most `zero_range_tol` is a
    zero-variance group: all its advantages are 0. Group sizes may differ.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=rewards.device)
        return GroupAdvantages(empty, empty.bool(), 0, 0)
    if group_ids.min() < 0:
        raise ValueError("group_ids must be >= 0; build them with group_index(keys)")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite; a reward of NaN or inf means a scoring bug")
    # float64 so that centering rewards like 0.1 + 0.2 does not leave float32 residue.
    values = rewards.double()
    index = group_ids.long().to(values.device)
    num_slots = int(index.max().item()) + 1
    sizes = torch.bincount(index, minlength=num_slots).double()
    present = sizes > 0
    means = _group_sum(values, index, num_slots) / sizes.clamp(min=1)
    centered = values - means[index]
    zero_group = (_group_range(values, index, num_slots) <= zero_range_tol) & present
    if normalize_std:
        stds = (_group_sum(centered**2, index, num_slots) / sizes.clamp(min=1)).sqrt()
        centered = centered / (stds[index] + std_eps)
    zero_sample = zero_group[index]
    advantages = torch.where(zero_sample, torch.zeros_like(centered), centered)
    return GroupAdvantages(
        advantages=advantages.float(),
        zero_variance=zero_sample,
        num_groups=int(present.sum().item()),
        num_zero_variance_groups=int(zero_group.sum().item()),
    )


def has_reward_variance(rewards: Sequence[float], zero_range_tol: float = ZERO_RANGE_TOL) -> bool:
    """Whether one group's `rewards` span more than `zero_range_tol`: a group whose rewards do
    not is a zero-variance group in `group_advantages` (every advantage 0). False when empty."""
    return bool(rewards) and max(rewards) - min(rewards) > zero_range_tol


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Sum of `values` per group slot [num_slots]."""
    return values.new_zeros(num_slots).index_add_(0, index, values)


def _group_range(values: torch.Tensor, index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """max - min of `values` per group slot [num_slots]; 0 for slots with no sample."""
    highs = values.new_zeros(num_slots).scatter_reduce(
        0, index, values, reduce="amax", include_self=False
    )
    lows = values.new_zeros(num_slots).scatter_reduce(
        0, index, values, reduce="amin", include_self=False
    )
    return highs - lows
