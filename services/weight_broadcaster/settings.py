"""Settings of the weight-broadcaster service, from RLPIPE_WEIGHT_BROADCASTER_* variables."""

from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import default_staging_dir


class WeightBroadcasterSettings(ServiceSettings):
    """Configuration of the weight-broadcaster service."""

    SERVICE: ClassVar[str] = "weight-broadcaster"
    model_config = SettingsConfigDict(
        env_prefix=env_prefix("weight-broadcaster"), **NESTED_SETTINGS
    )

    http_port: int = Field(9105, ge=0, le=65535, description="Port of /healthz and /metrics")
    staging_dir: Path | None = Field(
        None,
        description="Folder the trainer stages versions in (shared with it); "
        "default <run_dir>/weights-staging",
    )
    snapshot_every_versions: int = Field(
        10, ge=1, description="Deltas between full snapshots (K); the first version is one"
    )
    snapshot_when_idle_s: float = Field(
        60.0,
        ge=0,
        description="Snapshot the head when it is a delta and no version came for this long "
        "(workers that lost a delta wait for a snapshot; a trainer waiting for their samples "
        "stages none); 0: never",
    )
    encode: EncodeOptions = Field(
        default_factory=EncodeOptions,
        description="How versions are chunked and compressed (RLPIPE_WEIGHT_BROADCASTER_"
        "ENCODE_MAX_CHUNK_BYTES, _ENCODE_LEVEL, _ENCODE_THREADS)",
    )
    diff_device: str | None = Field(
        None,
        description="torch device to find deltas on (e.g. cuda, where the broadcaster shares "
        "the trainer's GPU host: the head's state is kept there); unset: a host scan",
    )
    publish_in_flight: int = Field(
        16, ge=1, description="Chunk publishes awaiting their stream ack at a time"
    )

    def resolved_staging_dir(self) -> Path:
        """The staging folder: the setting, or <run_dir>/weights-staging."""
        return self.staging_dir or default_staging_dir(self.run_dir)
