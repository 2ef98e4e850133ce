"""The one interface every tracker implements: log scalars at a step, close.

A backend is built with the run's parameters (the trainer's config, logged once) and the
folder it writes under; `log` takes flat `{"group/name": value}` scalars.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any


class Tracker(ABC):
    """One experiment tracker (TensorBoard, W&B, MLflow)."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` as the values at trainer step `step`."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; the tracker is not used after."""


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"policy": {"path": "m"}}` -> `{"policy.path": "m"}` (for trackers with flat params)."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
