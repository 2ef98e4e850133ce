"""TensorBoard: event files under `<run>/tracking/tensorboard/` (`tensorboard --logdir` it).

Written with torch's SummaryWriter (the `tensorboard` extra supplies its protobufs); the
trainer's config is logged once as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.tracking.backend import Tracker
from libs.tracking.config import require_extra


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path, params: Mapping[str, Any]) -> None:
        require_extra("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        text = json.dumps(params, indent=2, default=str)
        self.writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()
