"""Weights & Biases: offline by default, so a run needs no account and no network.

The run folder is `<run>/tracking/wandb/offline-run-*`; `wandb sync <that folder>` uploads it
later. The W&B run id is derived from the run folder, so a restarted trainer continues the
same W&B run. System stats and console capture are off: the trainer logs its own figures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.tracking.backend import Tracker
from libs.tracking.config import TrackingConfig, require_extra


def run_id(run_dir: Path) -> str:
    """A stable W&B run id for a run folder (W&B ids: letters and digits)."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class WandbTracker(Tracker):
    def __init__(
        self,
        config: TrackingConfig,
        run_dir: Path,
        log_dir: Path,
        name: str,
        params: Mapping[str, Any],
    ) -> None:
        require_extra("wandb")
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.project,
            name=name,
            id=run_id(run_dir),
            resume="allow",
            dir=str(log_dir),
            mode=config.wandb_mode,
            config=dict(params),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
