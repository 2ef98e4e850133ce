"""Settings of the trainer service, from RLPIPE_TRAINER_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class TrainerSettings(ServiceSettings):
    """Configuration of the trainer service."""

    SERVICE: ClassVar[str] = "trainer"
    model_config = SettingsConfigDict(env_prefix=env_prefix("trainer"), extra="ignore")

    http_port: int = Field(9101, ge=0, le=65535, description="Port of /healthz and /metrics")
