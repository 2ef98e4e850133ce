"""Builds the chosen trackers and fans every `log` out to them.

A tracker that fails to log (a full disk, an MLflow server away) is reported once and
dropped: tracking never stops training.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from libs.tracking.backend import Tracker
from libs.tracking.config import TrackingConfig

log = structlog.get_logger(__name__)


class Tracking:
    """Every chosen tracker behind one `log` and one `close` (none chosen: both do nothing)."""

    def __init__(self, trackers: Mapping[str, Tracker]) -> None:
        self.trackers = dict(trackers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # a tracker is a nicety: training goes on without it
                log.error("tracker failed; logging to it stops", tracker=name, error=repr(exc))
                del self.trackers[name]

    def close(self) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as exc:  # closing one must not keep the others open
                log.error("tracker failed to close", tracker=name, error=repr(exc))
        self.trackers = {}


def build_tracking(config: TrackingConfig, run_dir: Path, params: Mapping[str, Any]) -> Tracking:
    """The trackers `config` names, writing under `<run_dir>/tracking/`."""
    root = run_dir / "tracking"
    name = config.run_name or run_dir.resolve().name
    trackers: dict[str, Tracker] = {}
    for backend in config.backends:
        trackers[backend] = build_tracker(backend, config, run_dir, root, name, params)
    if trackers:
        log.info("tracking", backends=list(trackers), dir=str(root))
    return Tracking(trackers)


def build_tracker(
    backend: str,
    config: TrackingConfig,
    run_dir: Path,
    root: Path,
    name: str,
    params: Mapping[str, Any],
) -> Tracker:
    """One backend, its module imported only now."""
    if backend == "tensorboard":
        from libs.tracking.tensorboard_backend import TensorBoardTracker

        return TensorBoardTracker(root / "tensorboard", params)
    if backend == "wandb":
        from libs.tracking.wandb_backend import WandbTracker

        return WandbTracker(config, run_dir, root, name, params)
    if backend == "mlflow":
        from libs.tracking.mlflow_backend import MlflowTracker

        return MlflowTracker(config, root, name, params)
    raise ValueError(f"tracking backend {backend!r}: choose tensorboard, wandb or mlflow")
