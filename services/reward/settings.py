"""Settings of the reward service, from RLPIPE_REWARD_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class RewardSettings(ServiceSettings):
    """Configuration of the reward service."""

    SERVICE: ClassVar[str] = "reward"
    model_config = SettingsConfigDict(env_prefix=env_prefix("reward"), extra="ignore")

    http_port: int = Field(9104, ge=0, le=65535, description="Port of /healthz and /metrics")
    batch_size: int = Field(64, ge=1, description="Raw rollouts fetched per pull")
    concurrency: int = Field(16, ge=1, description="Rollouts scored at the same time")
    fetch_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one pull")
    mean_window_rollouts: int = Field(
        256, ge=1, description="Latest rollouts per env that the mean-reward gauges average"
    )
