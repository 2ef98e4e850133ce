"""Experiment tracking: the trainer's step metrics sent to TensorBoard, W&B and MLflow.

    RLPIPE_TRAINER_TRACKING_BACKENDS=tensorboard,wandb rlpipe demo --max-trainer-steps 50

    tracking = build_tracking(config.tracking, run_dir, params=config.model_dump(mode="json"))
    tracking.log({"reward/mean": 0.5, "train/learning_rate": 4e-4}, step=3)
    tracking.close()

Each backend is an optional extra (`pip install 'rlpipe[tensorboard]'`, `[wandb]`,
`[mlflow]`, or `[tracking]` for the three), imported only when chosen. They write under
`<run>/tracking/`: `tensorboard/` (event files: `tensorboard --logdir`), `wandb/` (offline
run folders: `wandb sync` uploads them), `mlruns/` (MLflow's file store: `mlflow ui
--backend-store-uri`). What is logged is the trainer's step record (libs.trainer.metrics).
"""

from libs.tracking.config import TrackingConfig
from libs.tracking.factory import Tracking, build_tracking

__all__ = ["Tracking", "TrackingConfig", "build_tracking"]
