"""Settings every service shares; each service subclasses with its own env prefix.

A service reads `RLPIPE_<SERVICE>_<FIELD>` (e.g. `RLPIPE_TRAINER_HTTP_PORT`). Fields that are
the same for a whole deployment also fall back to a shared variable: `RLPIPE_NATS_URL`,
`RLPIPE_NATS_REPLICAS`, `RLPIPE_PROVISION`, `RLPIPE_RUN_DIR`, `RLPIPE_LOG_LEVEL`,
`RLPIPE_LOG_FORMAT`. Optional
TOML: point `RLPIPE_CONFIG` at a file; the table named after the service (`[trainer]`) is
read, and environment variables win over it. Command-line overrides (`rlpipe run|demo --set
trainer.learning_rate=1e-4`) reach a service as `RLPIPE_SET` (JSON: {service: {field: value}})
and win over both.

A name that matches no field is refused with the nearest field named: a key of the service's
TOML table, a `RLPIPE_<SERVICE>_*` variable, an override. `load_settings` turns any mistake
into a `SettingsError` of one line per problem (what `rlpipe run` prints before exiting 2).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, FilePath, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

if TYPE_CHECKING:
    from libs.bus.connection import NatsOptions

SHARED_FALLBACKS = {
    "nats_url": "RLPIPE_NATS_URL",
    "provision": "RLPIPE_PROVISION",
    "run_dir": "RLPIPE_RUN_DIR",
    "log_level": "RLPIPE_LOG_LEVEL",
    "log_format": "RLPIPE_LOG_FORMAT",
    "nats_replicas": "RLPIPE_NATS_REPLICAS",
    "nats_user": "RLPIPE_NATS_USER",
    "nats_password": "RLPIPE_NATS_PASSWORD",
    "nats_nkey_seed_file": "RLPIPE_NATS_NKEY_SEED_FILE",
    "nats_creds_file": "RLPIPE_NATS_CREDS_FILE",
    "nats_inbox_prefix": "RLPIPE_NATS_INBOX_PREFIX",
    "nats_tls_ca_file": "RLPIPE_NATS_TLS_CA_FILE",
    "nats_tls_cert_file": "RLPIPE_NATS_TLS_CERT_FILE",
    "nats_tls_key_file": "RLPIPE_NATS_TLS_KEY_FILE",
}
CONFIG_VARIABLE = "RLPIPE_CONFIG"
OVERRIDES_VARIABLE = "RLPIPE_SET"
# Variables under a service's prefix that are not its settings: compose.yaml reads them on
# the host to pick GPUs (CUDA_VISIBLE_DEVICES); a service never sees them in its container.
NOT_SETTINGS = frozenset({"RLPIPE_TRAINER_GPUS", "RLPIPE_ROLLOUT_WORKER_GPUS"})


SettingsT = TypeVar("SettingsT", bound="ServiceSettings")


class SettingsError(ValueError):
    """Settings a service cannot start with; the message has one line per problem."""


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
        "(nats://user:password@host:4222; the password is masked in logs); a cluster's "
        "nodes comma-separated (nats://a:4222,nats://b:4222)",
    )
    nats_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="Nodes that keep each stream and KV bucket this service provisions: 1 for "
        "one nats-server, 3 on a NATS cluster (a node can then die with nothing acked lost)",
    )
    nats_user: str | None = Field(
        None,
        description="NATS user this service connects as: its role's user "
        "(deploy/nats/SECURITY.md); replies then arrive under `_INBOX_<role>`",
    )
    nats_password: str | None = Field(None, description="Password of nats_user (masked in logs)")
    nats_nkey_seed_file: FilePath | None = Field(
        None, description="File holding this service's NATS nkey seed (instead of a password)"
    )
    nats_creds_file: FilePath | None = Field(
        None, description="NATS credentials file (JWT and nkey seed, for operator-mode servers)"
    )
    nats_inbox_prefix: str | None = Field(
        None, description="Reply inbox prefix; unset: `_INBOX_<role>` for a role's user"
    )
    nats_tls_ca_file: FilePath | None = Field(
        None, description="CA certificate that signed the NATS server's (TLS; tls:// URLs)"
    )
    nats_tls_cert_file: FilePath | None = Field(
        None, description="Client certificate, where the server verifies clients (mTLS)"
    )
    nats_tls_key_file: FilePath | None = Field(
        None, description="Private key of nats_tls_cert_file"
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
    # Each attempt waits up to 4 s: a wrong URL fails in under 10 s with one error line (a
    # supervisor, compose or Kubernetes restarts a service that started before its bus).
    connect_attempts: int = Field(2, ge=1, description="Attempts at the first bus connection")

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

    @model_validator(mode="after")
    def _check_nats_credentials(self) -> ServiceSettings:
        """Credentials that cannot work together are refused before any connect."""
        if self.nats_password is not None and self.nats_user is None:
            raise ValueError("nats_password is set without nats_user: set RLPIPE_NATS_USER too")
        if self.nats_creds_file is not None and (self.nats_user or self.nats_nkey_seed_file):
            raise ValueError("nats_creds_file carries the identity: unset nats_user and "
                             "nats_nkey_seed_file")  # fmt: skip
        if (self.nats_tls_cert_file is None) != (self.nats_tls_key_file is None):
            raise ValueError("nats_tls_cert_file and nats_tls_key_file go together: set both")
        return self

    def nats_options(self) -> NatsOptions:
        """Who this service is on the bus and how its connection is protected."""
        from libs.bus.connection import NatsOptions

        return NatsOptions(
            user=self.nats_user,
            password=self.nats_password,
            nkey_seed_file=self.nats_nkey_seed_file,
            creds_file=self.nats_creds_file,
            inbox_prefix=self.nats_inbox_prefix,
            tls_ca_file=self.nats_tls_ca_file,
            tls_cert_file=self.nats_tls_cert_file,
            tls_key_file=self.nats_tls_key_file,
        )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_names(cls, data: Any) -> Any:
        """Unknown TOML keys, overrides and `RLPIPE_<SERVICE>_*` variables are errors that
        name the nearest field (pydantic-settings would skip them without a word)."""
        problems = [*unknown_variables(cls, os.environ)]
        if isinstance(data, dict):
            table, overrides = toml_table(cls.SERVICE), override_table(cls.SERVICE)
            for key in sorted(set(data) - set(cls.model_fields)):
                where = "--set" if key in overrides else "TOML" if key in table else "argument"
                problems.append(f"unknown {where} key {cls.SERVICE}.{key}{nearest(key, cls)}")
        if problems:
            raise ValueError("\n".join(problems))
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
        return (
            init_settings,
            OverridesSource(settings_cls),
            env_settings,
            TomlTableSource(settings_cls),
            file_secret_settings,
        )

    def redacted(self) -> dict[str, Any]:
        """The resolved settings for the start-up log, secrets and passwords in URLs masked
        (in nested configs too: `serve.api_key`)."""
        return redact(self.model_dump(mode="json"))


def redact(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with fields named like a secret and passwords in URLs masked, nested included."""
    masked: dict[str, Any] = {}
    for name, value in values.items():
        if is_secret(name):
            masked[name] = "***" if value else value
        elif isinstance(value, dict):
            masked[name] = redact(value)
        elif isinstance(value, str) and "://" in value:
            masked[name] = mask_url_password(value)
        else:
            masked[name] = value
    return masked


def is_secret(field: str) -> bool:
    """A field whose name (the last part of a dotted one) has a word of SECRET_WORDS."""
    return bool(SECRET_WORDS & set(field.rpartition(".")[2].split("_")))


class TomlTableSource(PydanticBaseSettingsSource):
    """The `[<service>]` table of the TOML file named by RLPIPE_CONFIG, if any."""

    def __call__(self) -> dict[str, Any]:
        return toml_table(getattr(self.settings_cls, "SERVICE", ""))

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False


class OverridesSource(PydanticBaseSettingsSource):
    """The service's command-line overrides (`--set`), carried by RLPIPE_SET."""

    def __call__(self) -> dict[str, Any]:
        return override_table(getattr(self.settings_cls, "SERVICE", ""))

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False


def toml_document() -> dict[str, Any]:
    """The TOML file named by RLPIPE_CONFIG ({} when unset); SettingsError if unreadable."""
    path = os.environ.get(CONFIG_VARIABLE)
    if not path:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"{CONFIG_VARIABLE}={path}: cannot read TOML ({exc})") from exc


def toml_table(service: str) -> dict[str, Any]:
    """The `[<service>]` table (dashes as underscores: `[rollout_worker]`), or {}."""
    table = toml_document().get(service.replace("-", "_"), {})
    return table if isinstance(table, dict) else {}


def override_table(service: str) -> dict[str, Any]:
    """The `--set` overrides of `service` carried by RLPIPE_SET, nested by field."""
    text = os.environ.get(OVERRIDES_VARIABLE)
    if not text:
        return {}
    try:
        table = json.loads(text).get(service, {})
    except (ValueError, AttributeError) as exc:
        raise SettingsError(f"{OVERRIDES_VARIABLE} is not a JSON object of tables: {exc}") from exc
    return table if isinstance(table, dict) else {}


def parse_override(text: str) -> tuple[str, list[str], Any]:
    """`trainer.policy.path=models/x` -> ("trainer", ["policy", "path"], "models/x").

    A value that reads as a JSON list or object (`[...]`, `{...}`) is decoded; any other
    value stays text for the field's own validation (`1e-4`, `true`, `debug`)."""
    name, sep, value = text.partition("=")
    service, _, dotted = name.strip().partition(".")
    if not sep or not service or not dotted:
        raise SettingsError(
            f"--set {text!r}: write SERVICE.FIELD=VALUE (trainer.learning_rate=1e-4)"
        )
    decoded: Any = value
    if value.strip()[:1] in ("[", "{"):
        try:
            decoded = json.loads(value)
        except ValueError as exc:
            raise SettingsError(f"--set {text!r}: the value is not valid JSON ({exc})") from exc
    return service.replace("_", "-"), dotted.split("."), decoded


def merge_overrides(texts: list[str], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """RLPIPE_SET's tables with `texts` (SERVICE.FIELD=VALUE) added, later ones winning."""
    tables: dict[str, Any] = dict(into or {})
    for text in texts:
        service, path, value = parse_override(text)
        table = tables.setdefault(service, {})
        for part in path[:-1]:
            table = table.setdefault(part, {})
        table[path[-1]] = value
    return tables


def nested_fields(cls: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Top-level fields of `cls` whose type is a pydantic model (`policy`, `eval`)."""
    found = {}
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found[name] = annotation
    return found


def variable_names(cls: type[ServiceSettings]) -> dict[str, str]:
    """Every variable `cls` reads -> the field it sets (`RLPIPE_TRAINER_POLICY_PATH` ->
    `policy.path`); nested ones only where the class splits names (NESTED_SETTINGS)."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    names = {f"{prefix}{name.upper()}": name for name in cls.model_fields}
    if cls.model_config.get("env_nested_delimiter"):
        for name, model in nested_fields(cls).items():
            for sub in model.model_fields:
                names[f"{prefix}{name.upper()}_{sub.upper()}"] = f"{name}.{sub}"
    return names


def unknown_variables(
    cls: type[ServiceSettings], environ: dict[str, str] | os._Environ[str]
) -> Iterator[str]:
    """A problem line for each `RLPIPE_<SERVICE>_*` variable that sets no field of `cls`."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    known = variable_names(cls)
    for variable in sorted(environ):
        upper = variable.upper()
        if upper.startswith(prefix) and upper not in known and upper not in NOT_SETTINGS:
            field = upper.removeprefix(prefix).lower()
            yield f"unknown variable {variable}{nearest(field, cls)}"


def nearest(name: str, cls: type[ServiceSettings]) -> str:
    """` (did you mean X?)` naming the field closest to `name`, or a pointer to the list."""
    candidates = [*cls.model_fields, *(v.replace(".", "_") for v in variable_names(cls).values())]
    match = difflib.get_close_matches(name.lower(), candidates, n=1, cutoff=0.6)
    service = cls.SERVICE
    if not match:
        return f" (no such field; see `rlpipe config show {service}`)"
    field = match[0]
    dotted = variable_names(cls).get(
        f"{str(cls.model_config.get('env_prefix', '')).upper()}{field.upper()}", field
    )
    return f" (did you mean {dotted}?)"


def load_settings(cls: type[SettingsT]) -> SettingsT:
    """`cls()` read from overrides, variables and TOML; SettingsError with one line per
    problem (the variable or key, what is wrong) instead of pydantic's report."""
    try:
        return cls()
    except ValidationError as exc:
        raise SettingsError("\n".join(describe_error(cls, e) for e in exc.errors())) from None


def settings_or_exit(cls: type[SettingsT]) -> SettingsT:
    """`load_settings` for a service's main: a mistake prints `error: ...` lines on stderr
    and exits 2, without a traceback."""
    try:
        return load_settings(cls)
    except SettingsError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)


def describe_error(cls: type[ServiceSettings], error: Any) -> str:
    """One line for one pydantic error: where the value came from, the field, the reason."""
    message = str(error["msg"]).removeprefix("Value error, ")
    location = ".".join(str(part) for part in error["loc"])
    if not location:
        return "\n".join(f"{cls.SERVICE}: {line}" for line in message.splitlines())
    value = error.get("input")
    shown = f" = {value!r}" if isinstance(value, (str, int, float, bool)) else ""
    return f"{cls.SERVICE}.{location}{shown}: {message} ({setting_source(cls, location)})"


def setting_source(cls: type[ServiceSettings], dotted: str) -> str:
    """Where the value of field `dotted` (`learning_rate`, `policy.path`) came from:
    `--set`, the variable that set it, the TOML file, or `default`."""
    parts = dotted.split(".")
    if _lookup(override_table(cls.SERVICE), parts) is not None:
        return "--set"
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    upper = {name.upper(): name for name in os.environ}
    candidates = [prefix + "_".join(parts).upper(), prefix + parts[0].upper()]
    if parts[0] in SHARED_FALLBACKS:
        candidates.append(SHARED_FALLBACKS[parts[0]])
    for variable in candidates:
        if variable in upper:
            return f"env {upper[variable]}"
    if _lookup(toml_table(cls.SERVICE), parts) is not None:
        return f"TOML {os.environ.get(CONFIG_VARIABLE)}"
    return "default"


def _lookup(table: dict[str, Any], parts: list[str]) -> Any:
    value: Any = table
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


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
