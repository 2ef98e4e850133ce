"""Settings of the weight-broadcaster service, from RLPIPE_WEIGHT_BROADCASTER_* variables."""

from pathlib import Path
from typing import ClassVar, Self

from pydantic import Field, model_validator
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
    signing_key: Path | None = Field(
        None,
        description="Private key signing every announced version (`rlpipe weights keygen`; "
        "workers verify with its .pub); required unless allow_unsigned",
    )
    allow_unsigned: bool = Field(
        False,
        description="Announce versions unsigned when no signing_key is set (workers then need "
        "weights.allow_unsigned): only where every publisher on the bus is trusted",
    )

    @model_validator(mode="after")
    def _signs(self) -> Self:
        if self.signing_key is None and not self.allow_unsigned:
            raise ValueError(
                "signing_key is unset: the broadcaster signs every version it announces. Set "
                "RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY to a private key (`rlpipe weights "
                "keygen --out DIR`; `rlpipe demo` makes one per run) or, where every publisher "
                "on the bus is trusted, RLPIPE_WEIGHT_BROADCASTER_ALLOW_UNSIGNED=true"
            )
        return self

    def resolved_staging_dir(self) -> Path:
        """The staging folder: the setting, or <run_dir>/weights-staging."""
        return self.staging_dir or default_staging_dir(self.run_dir)
