"""MLflow: one MLflow run per rlpipe run, in a local file store unless a URI is given.

The default store is `<run>/tracking/mlruns` (`mlflow ui --backend-store-uri` it; MLflow 3
keeps its file store in maintenance mode, so MLFLOW_ALLOW_FILE_STORE is set for it). The
MLflow run id is kept in `<run>/tracking/mlflow_run_id`, so a restarted trainer logs to the
same run; the trainer's config goes in as parameters when the run is created.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.tracking.backend import Tracker, flatten
from libs.tracking.config import TrackingConfig, require_extra

# MLflow refuses parameter values longer than this.
MAX_PARAM_CHARS = 6000


class MlflowTracker(Tracker):
    def __init__(
        self, config: TrackingConfig, log_dir: Path, name: str, params: Mapping[str, Any]
    ) -> None:
        require_extra("mlflow")
        uri = config.mlflow_tracking_uri or (log_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._resume_or_create(
            config.project, log_dir / "mlflow_run_id", name, params
        )

    def _resume_or_create(
        self, experiment: str, id_path: Path, name: str, params: Mapping[str, Any]
    ) -> str:
        if id_path.exists():
            return id_path.read_text().strip()
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(experiment_id, run_name=name)
        from mlflow.entities import Param

        values = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(params).items()]
        self.client.log_batch(run.info.run_id, params=values)
        id_path.parent.mkdir(parents=True, exist_ok=True)
        id_path.write_text(run.info.run_id + "\n")
        return str(run.info.run_id)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        values = [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=values)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
