"""Settings of the env-gateway service, from RLPIPE_ENV_GATEWAY_* variables."""

from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from libs.envs.latency import parse_tool_latency
from libs.settings import ServiceSettings, env_prefix


class EnvGatewaySettings(ServiceSettings):
    """Configuration of the env-gateway service."""

    SERVICE: ClassVar[str] = "env-gateway"
    model_config = SettingsConfigDict(env_prefix=env_prefix("env-gateway"), extra="ignore")

    http_port: int = Field(9103, ge=0, le=65535, description="Port of /healthz and /metrics")
    env: str = Field("arith", description="Environment whose tasks the feeder publishes")
    difficulty: int = Field(0, ge=0, description="Task difficulty (arith: digits per operand)")
    group_size: int = Field(16, ge=1, description="Rollouts per task (the GRPO group)")
    feeder_mode: Literal["async", "sync", "off"] = Field(
        "async",
        description="async: keep the queue at queue_depth_tasks; sync: batch_groups tasks per "
        "new policy version; off: serve episodes only",
    )
    queue_depth_tasks: int = Field(
        32, ge=1, description="Tasks kept pending or in progress (async mode)"
    )
    batch_groups: int = Field(
        16,
        ge=1,
        description="Tasks per trainer batch: per version in sync mode, the unit of "
        "max_ahead_versions in async mode (match the trainer's batch_groups)",
    )
    max_ahead_versions: int | None = Field(
        1,
        ge=0,
        description="async: batches the feeder may run ahead of the trainer (bounds "
        "staleness); unset for no bound",
    )
    seed: int = Field(0, description="Seed of task generation")
    feeder_poll_interval_s: float = Field(
        0.2, gt=0, description="How often the feeder checks queue depth or policy version"
    )
    episode_timeout_s: float = Field(600.0, gt=0, description="Deadline of an episode")
    step_timeout_s: float = Field(30.0, gt=0, description="Longest a reset or step may run")
    max_open_episodes: int = Field(10_000, ge=1, description="Episodes one gateway holds at most")
    tool_latency: str = Field(
        "none",
        description="Latency of each tool call (libs.envs.latency): none, constant:seconds=S or "
        "lognormal:median_s=M,sigma=S,max_s=X (heavy-tailed, for benchmarks)",
    )

    @field_validator("tool_latency")
    @classmethod
    def _latency_parses(cls, value: str) -> str:
        parse_tool_latency(value)
        return value
