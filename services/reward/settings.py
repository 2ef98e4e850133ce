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
