"""Settings every service shares; each service subclasses with its own env prefix.

A service reads `RLPIPE_<SERVICE>_<FIELD>` (e.g. `RLPIPE_TRAINER_HTTP_PORT`). Fields that are
the same for a whole deployment also fall back to a shared variable: `RLPIPE_NATS_URL`,
`RLPIPE_PROVISION`, `RLPIPE_RUN_DIR`, `RLPIPE_LOG_LEVEL`, `RLPIPE_LOG_FORMAT`. Optional
TOML: point `RLPIPE_CONFIG` at a file; the table named after the service (`[trainer]`) is
read, and environment variables win over it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

SHARED_FALLBACKS = {
    "nats_url": "RLPIPE_NATS_URL",
    "provision": "RLPIPE_PROVISION",
    "run_dir": "RLPIPE_RUN_DIR",
    "log_level": "RLPIPE_LOG_LEVEL",
    "log_format": "RLPIPE_LOG_FORMAT",
}


# How every service reads nested configs from its variables: the part of the name after the
# service prefix splits once at "_", so `RLPIPE_TRAINER_POLICY_PATH` sets `policy.path` and
# `RLPIPE_TRAINER_LEARNING_RATE` stays the flat `learning_rate`. A variable that names an
# unknown field of a nested config is refused (`extra="forbid"` there).
NESTED_SETTINGS = SettingsConfigDict(
    env_nested_delimiter="_", env_nested_max_split=1, extra="ignore", frozen=True
)


# A field whose name has one of these words (split at "_") is masked in the start-up log.
SECRET_WORDS = frozenset({"key", "keys", "secret", "password", "token", "credentials"})


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses set `SERVICE` and `model_config`'s env_prefix."""

    SERVICE: ClassVar[str] = "service"
    model_config = SettingsConfigDict(extra="ignore")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="URL of the NATS server, with credentials where it has users "
        "(nats://user:password@host:4222; the password is masked in logs)",
    )
    provision: bool = Field(
        True,
        description="Create or update the bus definitions at start; off for a service whose "
        "user may not (deploy/nats/SECURITY.md), while another service or "
        "`rlpipe provision` does it",
    )
    http_host: str = Field("127.0.0.1", description="Address of the health and metrics server")
    http_port: int = Field(9100, ge=0, le=65535, description="Port of /healthz and /metrics")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Lowest log level written"
    )
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="json when not on a terminal, unless set"
    )
    run_dir: Path = Field(Path("runs/local"), description="Folder for this run's state")
    drain_timeout_s: float = Field(
        10.0, gt=0, description="Time in-flight work gets to finish on SIGTERM"
    )
    connect_attempts: int = Field(10, ge=1, description="Attempts at the first bus connection")

    @model_validator(mode="before")
    @classmethod
    def _shared_fallbacks(cls, data: Any) -> Any:
        """Fill deployment-wide fields from their shared variable when not set per service."""
        if not isinstance(data, dict):
            return data
        for field, variable in SHARED_FALLBACKS.items():
            if field not in data and variable in os.environ:
                data[field] = os.environ[variable]
        return data

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlTableSource(settings_cls), file_secret_settings)

    def redacted(self) -> dict[str, Any]:
        """The resolved settings for the start-up log, secrets and passwords in URLs masked."""
        values = self.model_dump(mode="json")
        for name, value in values.items():
            if SECRET_WORDS & set(name.split("_")):
                values[name] = "***" if value else value
            elif isinstance(value, str) and "://" in value:
                values[name] = mask_url_password(value)
        return values


class TomlTableSource(PydanticBaseSettingsSource):
    """The `[<service>]` table of the TOML file named by RLPIPE_CONFIG, if any."""

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("RLPIPE_CONFIG")
        if not path:
            return {}
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"RLPIPE_CONFIG={path}: cannot read TOML ({exc})") from exc
        service: str = getattr(self.settings_cls, "SERVICE", "")
        table = document.get(service.replace("-", "_"), {})
        return table if isinstance(table, dict) else {}

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False


def mask_url_password(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://user:***@host:4222`; a bare token -> `***`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    _, _, hostport = parts.netloc.rpartition("@")
    user = f"{parts.username}:***" if parts.password is not None else "***"
    return urlunsplit(parts._replace(netloc=f"{user}@{hostport}"))


def env_prefix(service: str) -> str:
    """`rollout-worker` -> `RLPIPE_ROLLOUT_WORKER_`."""
    return f"RLPIPE_{service.upper().replace('-', '_')}_"
