"""Which trackers the trainer logs to, and how: the `tracking` part of the trainer's config.

    RLPIPE_TRAINER_TRACKING_BACKENDS=tensorboard,wandb     (or a JSON list)
    RLPIPE_TRAINER_TRACKING_PROJECT=my-agent
    [trainer.tracking]  backends = ["mlflow"]               (TOML)

A backend whose extra is not installed is refused here, at start, with the install line.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode

# The module each backend imports, and the extra that installs it.
BACKEND_MODULES: dict[str, str] = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}


class MissingExtraError(ValueError):
    """A chosen backend's package is not installed (a ValueError: config validation says it)."""


def require_extra(backend: str) -> None:
    """Raise MissingExtraError naming the install line when `backend`'s package is missing."""
    module = BACKEND_MODULES[backend]
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(
            f"tracking backend {backend!r} needs the {module} package: "
            f"pip install 'rlpipe[{backend}]' (or 'rlpipe[tracking]' for all three)"
        )


class TrackingConfig(BaseModel):
    """Experiment trackers the trainer's step metrics go to (none by default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backends: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Trackers to log to: tensorboard, wandb, mlflow (comma-separated)",
    )
    project: str = Field(
        "rlpipe", min_length=1, description="W&B project and MLflow experiment name"
    )
    run_name: str | None = Field(
        None, description="Name of the run in the trackers (default: the run folder's name)"
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes locally, no network (`wandb sync` later)"
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI, e.g. http://mlflow:5000 (default: a file store "
        "in <run>/tracking/mlruns)",
    )

    @field_validator("backends", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """ "tensorboard,wandb" or '["tensorboard"]' (an environment variable) -> a list."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]

    @field_validator("backends")
    @classmethod
    def _known_and_installed(cls, value: list[str]) -> list[str]:
        for backend in value:
            if backend not in BACKEND_MODULES:
                choices = ", ".join(BACKEND_MODULES)
                raise ValueError(f"unknown tracker {backend!r}: choose from {choices}")
            require_extra(backend)
        return list(dict.fromkeys(value))
