"""Settings of the feedback-ingester service, from RLPIPE_FEEDBACK_INGESTER_* variables."""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import ServiceSettings, env_prefix


class FeedbackIngesterSettings(ServiceSettings):
    """Configuration of the feedback-ingester service."""

    SERVICE: ClassVar[str] = "feedback-ingester"
    model_config = SettingsConfigDict(env_prefix=env_prefix("feedback-ingester"), extra="ignore")

    http_port: int = Field(9106, ge=0, le=65535, description="Port of /healthz and /metrics")
