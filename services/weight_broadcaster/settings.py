"""Settings of the weight-broadcaster service, from RLPIPE_WEIGHT_BROADCASTER_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class WeightBroadcasterSettings(ServiceSettings):
    """Configuration of the weight-broadcaster service."""

    SERVICE: ClassVar[str] = "weight-broadcaster"
    model_config = SettingsConfigDict(env_prefix=env_prefix("weight-broadcaster"), extra="ignore")

    http_port: int = Field(9105, ge=0, le=65535, description="Port of /healthz and /metrics")
