"""Settings of the feedback-ingester service, from RLPIPE_FEEDBACK_INGESTER_* variables.

API keys: `RLPIPE_FEEDBACK_INGESTER_API_KEYS` (JSON list of {name, sha256, products}) and/or
`RLPIPE_FEEDBACK_INGESTER_API_KEYS_FILE` (a TOML/JSON secret file); see libs.feedback.auth.
"""

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from libs.feedback.auth import ApiKeyEntry
from libs.feedback.restricted_bus import DEFAULT_INBOX_PREFIX
from libs.settings import ServiceSettings, env_prefix


class FeedbackIngesterSettings(ServiceSettings):
    """Configuration of the feedback-ingester service."""

    SERVICE: ClassVar[str] = "feedback-ingester"
    model_config = SettingsConfigDict(env_prefix=env_prefix("feedback-ingester"), extra="ignore")

    http_port: int = Field(9106, ge=0, le=65535, description="Port of /healthz and /metrics")
    role: Literal["all", "api", "join"] = Field(
        "all", description="Run the HTTP API, the join, or both in this process"
    )

    # --- the HTTP API ---
    api_host: str | None = Field(
        None, description="Address of the feedback API; http_host if unset"
    )
    api_port: int = Field(8080, ge=0, le=65535, description="Port of the feedback API")
    api_keys: list[ApiKeyEntry] = Field(
        default_factory=list, description="API keys (hashed) as JSON: [{name, sha256, products}]"
    )
    api_keys_file: Path | None = Field(
        None, description="Secret TOML/JSON file with a `keys` list, added to api_keys"
    )
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="Largest request body, bytes")
    max_batch_events: int = Field(500, ge=1, description="Most events in one batch request")
    rate_per_s: float = Field(
        1000.0, gt=0, description="Events a second per API key, sustained, over all replicas"
    )
    rate_burst_events: int = Field(2000, ge=1, description="Events per API key in a burst")
    rate_lease_events: int = Field(
        50,
        ge=1,
        description="Most events of a key's shared rate a replica takes from the bus at a time "
        "(at most a burst, and what the rate gives in 1 s; unspent after 1 s: dropped)",
    )
    publish_timeout_s: float = Field(2.0, gt=0, description="Wait for the stream's ack, per try")
    publish_attempts: int = Field(3, ge=1, description="Tries to store an event before a 503")
    publish_max_in_flight: int = Field(
        1024, ge=1, description="Unacknowledged feedback publishes at a time"
    )
    api_nats_url: str | None = Field(
        None,
        description="NATS URL with the feedback-only user's credentials for the API's publishes "
        "(deploy/nats/auth.conf); the service's own connection if unset",
    )
    api_nats_inbox_prefix: str = Field(
        DEFAULT_INBOX_PREFIX, description="Reply inbox prefix the feedback-only user may read"
    )

    # --- the join ---
    join_window_s: float = Field(
        3600.0, ge=1, description="How long an event waits for its generation, and vice versa"
    )
    join_sweep_interval_s: float = Field(
        30.0, gt=0, description="How often waiting events are checked for expiry"
    )
    join_batch_size: int = Field(64, ge=1, description="Messages fetched per pull")
    join_concurrency: int = Field(
        64,
        ge=1,
        description="Messages joined at the same time (each waits on a few bus round trips)",
    )
    join_fetch_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one pull")
    join_generation_sample_cap: int = Field(
        4,
        ge=1,
        description="Most training samples from one generation id; later events on it are "
        "stored as feedback, not trained on",
    )
    join_key_sample_cap: int = Field(
        20_000,
        ge=1,
        description="Most training samples from one API key's events per "
        "join_key_sample_window_s (a budget shared by every joiner)",
    )
    join_key_sample_window_s: float = Field(
        3600.0, gt=0, description="The window of join_key_sample_cap, seconds"
    )

    @model_validator(mode="after")
    def _batch_fits_burst(self) -> "FeedbackIngesterSettings":
        if self.max_batch_events > self.rate_burst_events:
            raise ValueError(
                f"max_batch_events ({self.max_batch_events}) exceeds rate_burst_events "
                f"({self.rate_burst_events}): a full batch could never pass the rate limit"
            )
        return self

    @property
    def resolved_api_host(self) -> str:
        return self.api_host or self.http_host
