"""Settings of the env-gateway service, from RLPIPE_ENV_GATEWAY_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class EnvGatewaySettings(ServiceSettings):
    """Configuration of the env-gateway service."""

    SERVICE: ClassVar[str] = "env-gateway"
    model_config = SettingsConfigDict(env_prefix=env_prefix("env-gateway"), extra="ignore")

    http_port: int = Field(9103, ge=0, le=65535, description="Port of /healthz and /metrics")
