"""Settings of the trainer service, from RLPIPE_TRAINER_* variables.

The fields are the trainer loop's own (`libs.trainer.config.TrainerConfig`, declared once
there) plus the service's: `RLPIPE_TRAINER_LEARNING_RATE`, `RLPIPE_TRAINER_POLICY_PATH`,
`RLPIPE_TRAINER_EVAL_EVERY_VERSIONS`, `RLPIPE_TRAINER_ONLINE_FRACTION`, ...
"""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix
from libs.trainer.config import TrainerConfig


class TrainerSettings(ServiceSettings, TrainerConfig):
    """Configuration of the trainer service: the loop's config, read from the environment."""

    SERVICE: ClassVar[str] = "trainer"
    model_config = SettingsConfigDict(env_prefix=env_prefix("trainer"), **NESTED_SETTINGS)

    http_port: int = Field(9101, ge=0, le=65535, description="Port of /healthz and /metrics")
