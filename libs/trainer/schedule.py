"""The trainer's learning-rate schedule: linear decay to a floor, a function of the step alone.

    learning_rate_at(config, step)   # config.learning_rate, decayed over
                                     # learning_rate_decay_steps to min_learning_rate_ratio

A resumed trainer gets the rate of its checkpoint's step: no schedule state to save.
"""

from __future__ import annotations

from libs.trainer.config import TrainerConfig


def learning_rate_at(config: TrainerConfig, step: int) -> float:
    """The learning rate of step `step` (0-based), from the step alone so a resume agrees."""
    if config.learning_rate is None:
        raise ValueError("the learning rate is unset: resolve it with TrainerConfig.sized_for")
    if config.learning_rate_decay_steps is None:
        return config.learning_rate
    progress = min(step / config.learning_rate_decay_steps, 1.0)
    return config.learning_rate * (1.0 - (1.0 - config.min_learning_rate_ratio) * progress)
