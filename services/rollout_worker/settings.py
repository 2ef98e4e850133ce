"""Settings of the rollout-worker service, from RLPIPE_ROLLOUT_WORKER_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class RolloutWorkerSettings(ServiceSettings):
    """Configuration of the rollout-worker service."""

    SERVICE: ClassVar[str] = "rollout-worker"
    model_config = SettingsConfigDict(env_prefix=env_prefix("rollout-worker"), extra="ignore")

    http_port: int = Field(9102, ge=0, le=65535, description="Port of /healthz and /metrics")
