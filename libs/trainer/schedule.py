"""The trainer's learning-rate schedule: linear decay to a floor, a function of the step alone.

    learning_rate_at(config, step)   # config.learning_rate, decayed over
                                     # learning_rate_decay_steps to min_learning_rate_ratio
    set_learning_rate(optimizer, learning_rate_at(config, step))
    learning_rate_of(optimizer)      # the rate the optimizer steps at now

A resumed trainer gets the rate of its checkpoint's step: no schedule state to save.
"""

from __future__ import annotations

import torch

from libs.trainer.config import TrainerConfig


def learning_rate_at(config: TrainerConfig, step: int) -> float:
    """The learning rate of step `step` (0-based), from the step alone so a resume agrees."""
    if config.learning_rate is None:
        raise ValueError("the learning rate is unset: resolve it with TrainerConfig.sized_for")
    if config.learning_rate_decay_steps is None:
        return config.learning_rate
    progress = min(step / config.learning_rate_decay_steps, 1.0)
    return config.learning_rate * (1.0 - (1.0 - config.min_learning_rate_ratio) * progress)


def set_learning_rate(optimizer: torch.optim.Optimizer, learning_rate: float) -> None:
    """Step `optimizer` at `learning_rate` from now on (every parameter group)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate


def learning_rate_of(optimizer: torch.optim.Optimizer) -> float:
    """The rate `optimizer` steps at now."""
    return float(optimizer.param_groups[0]["lr"])
