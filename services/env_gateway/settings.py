"""Settings of the env-gateway service, from RLPIPE_ENV_GATEWAY_* variables."""

from pathlib import Path
from typing import ClassVar, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from libs.domains.dataset.env import ENV_NAME as DATASET_ENV
from libs.domains.dataset.env import DatasetConfig, check_match, load_rows
from libs.envs.feeder import FeederConfig
from libs.envs.latency import parse_tool_latency
from libs.envs.server import ServerLimits
from libs.region.intake import TaskIntakeConfig
from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix


class EnvGatewaySettings(ServiceSettings):
    """Configuration of the env-gateway service."""

    SERVICE: ClassVar[str] = "env-gateway"
    model_config = SettingsConfigDict(env_prefix=env_prefix("env-gateway"), **NESTED_SETTINGS)

    http_port: int = Field(9103, ge=0, le=65535, description="Port of /healthz and /metrics")
    env: str = Field("arith", description="Environment whose tasks the feeder publishes")
    difficulty: int = Field(0, ge=0, description="Task difficulty (arith: digits per operand)")
    group_size: int = Field(16, ge=1, description="Rollouts per task (the GRPO group)")
    feeder: FeederConfig = Field(
        default_factory=FeederConfig,
        description="How tasks are fed (RLPIPE_ENV_GATEWAY_FEEDER_MODE, _QUEUE_DEPTH_TASKS, "
        "...); the batch size is the trainer's own, read from its state",
    )
    intake: TaskIntakeConfig = Field(
        default_factory=TaskIntakeConfig,
        description="A region's gateway: tasks taken from the hub's queue into the region's "
        "(RLPIPE_ENV_GATEWAY_INTAKE_HUB_DOMAIN, _BUFFER_TASKS, ...); feeder.mode must be off",
    )
    seed: int = Field(0, description="Seed of task generation")
    limits: ServerLimits = Field(
        default_factory=ServerLimits,
        description="Deadlines of episodes and steps, episodes held at once "
        "(RLPIPE_ENV_GATEWAY_LIMITS_STEP_TIMEOUT_S, ...)",
    )
    tool_latency: str = Field(
        "none",
        description="Latency of each tool call (libs.envs.latency): none, constant:seconds=S or "
        "lognormal:median_s=M,sigma=S,max_s=X (heavy-tailed, for benchmarks)",
    )

    dataset_path: Path | None = Field(
        None,
        description="JSONL or parquet file of {prompt, answer, metadata} rows served as env "
        "'dataset' (libs.domains.dataset); set env=dataset to feed them",
    )
    dataset_match: str = Field(
        "exact", description="How dataset answers are checked: exact, numeric, regex, module:fn"
    )
    dataset_max_tokens: int = Field(64, ge=1, description="Longest answer to a dataset task")

    @model_validator(mode="after")
    def _one_source_of_tasks(self) -> Self:
        if self.intake.hub_domain and self.feeder.mode != "off":
            raise ValueError(
                f"intake.hub_domain is set (a region's gateway takes its tasks from the hub's "
                f"queue) and feeder.mode is {self.feeder.mode!r}: a region feeds no tasks of its "
                "own; set RLPIPE_ENV_GATEWAY_FEEDER_MODE=off"
            )
        return self

    @model_validator(mode="after")
    def _dataset_reads(self) -> Self:
        """A dataset file is read at start: a bad row stops the service naming line and field."""
        config = self.dataset_config()
        if config is not None:
            load_rows(config.path)
        elif self.env == DATASET_ENV:
            raise ValueError("env is 'dataset': set dataset_path (RLPIPE_ENV_GATEWAY_DATASET_PATH)")
        return self

    def dataset_config(self) -> DatasetConfig | None:
        """The dataset env's file and answer check, None without `dataset_path`."""
        if self.dataset_path is None:
            return None
        return DatasetConfig(
            path=self.dataset_path, match=self.dataset_match, max_tokens=self.dataset_max_tokens
        )

    @field_validator("dataset_match")
    @classmethod
    def _match_known(cls, value: str) -> str:
        return check_match(value)

    @field_validator("tool_latency")
    @classmethod
    def _latency_parses(cls, value: str) -> str:
        parse_tool_latency(value)
        return value
