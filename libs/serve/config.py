"""`ServeConfig`: where serve mode listens, who may call it, and how much it may take.

The rollout-worker's `serve` settings (`RLPIPE_ROLLOUT_WORKER_SERVE_<FIELD>`). Four groups:
- listening: `port` (0: off), `host`, `model_name`;
- keys: `api_key` (one secret) and/or `api_keys` (named entries holding the key's sha256,
  as `rlpipe feedback-key` prints them); required whenever `host` is not a loopback address;
- a request's bounds (a 400 names the limit): `max_choices`, `max_tokens`, `max_stop`,
  `max_stop_chars`, `max_body_bytes`;
- admission (a 429 with Retry-After when full): `max_running_requests`,
  `max_queued_requests`, `max_requests_per_key`, `max_tokens_per_key`; the engine's share:
  `hold_tokens` (decode steps a served request holds the engine before rollouts and weight
  swaps get their turn) and `engine_share` (the most of the engine's time served requests
  take on a worker that also rolls out); slow clients: `header_timeout_s`,
  `body_timeout_s`, `max_connections`.
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libs.api_server import HttpLimits

DEFAULT_KEY_NAME = "api_key"
"""The name requests with `api_key` are counted and logged under."""
KEY_SETTING = "RLPIPE_ROLLOUT_WORKER_SERVE_API_KEY"


class ServeKeyEntry(BaseModel):
    """One named key: who holds it (logs and budgets) and the sha256 of the secret."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # a feedback key's products too

    name: str = Field(min_length=1, max_length=64, description="Who holds the key")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the key, lowercase hex")


class ServeConfig(BaseModel):
    """Where the OpenAI-compatible API listens, what it serves and accepts (the
    rollout-worker's `serve`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int = Field(
        0, ge=0, le=65535, description="Port of the OpenAI-compatible API; 0: serve mode off"
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the OpenAI-compatible API binds; beyond loopback a key is required",
    )
    model_name: str = Field(
        "rlpipe-policy", min_length=1, description="Model name the API serves (`model` field)"
    )
    api_key: str | None = Field(
        None, description="Secret required as `Authorization: Bearer <key>`; unset: open"
    )
    api_keys: list[ServeKeyEntry] = Field(
        default_factory=list,
        description='More keys, JSON [{"name", "sha256"}] (rlpipe feedback-key prints one)',
    )
    max_choices: int = Field(16, ge=1, description="Largest `n` of one request")
    default_max_tokens: int = Field(
        256, ge=1, description="Chat completion tokens when a request sets no max"
    )
    max_tokens: int = Field(
        2048, ge=1, description="Largest max_tokens (max_completion_tokens) a request may ask"
    )
    max_stop: int = Field(16, ge=0, description="Most `stop` strings of one request")
    max_stop_chars: int = Field(128, ge=1, description="Longest `stop` string, in characters")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body")
    not_ready_retry_after_s: int = Field(
        1, ge=0, description="Retry-After of a 503 while no weights are loaded"
    )
    max_running_requests: int = Field(
        4, ge=1, description="Requests generating at once; more wait in the queue"
    )
    max_queued_requests: int = Field(
        16, ge=0, description="Requests waiting for a generating slot; more get 429"
    )
    max_requests_per_key: int = Field(
        8, ge=1, description="Requests of one key generating or queued; more get 429"
    )
    max_tokens_per_key: int = Field(
        262_144,
        ge=1,
        description="Tokens one key's open requests may hold, n * (prompt + max_tokens) "
        "summed; more get 429",
    )
    busy_retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429")
    hold_tokens: int = Field(
        8,
        ge=1,
        description="Decode steps a served request holds the engine before rollouts and "
        "weight swaps get their turn (it then goes on from where it was)",
    )
    engine_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Most of the engine's time served requests take while the worker also "
        "rolls out tasks (a serving-only replica gives them all of it)",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a client has to send a request's head"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time a client has to send a request's body after its head"
    )
    max_connections: int = Field(
        1024, ge=1, description="Open connections beyond which new requests get 503"
    )

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> Self:
        if self.port and not self.key_hashes() and not is_loopback(self.host):
            raise ValueError(
                f"serve.host {self.host!r} listens beyond loopback without a key: set "
                f"{KEY_SETTING} (or _API_KEYS), or bind serve.host to 127.0.0.1"
            )
        return self

    def key_hashes(self) -> dict[str, str]:
        """The sha256 (hex) of every accepted key, to the name it is counted under."""
        hashes = {entry.sha256: entry.name for entry in self.api_keys}
        if self.api_key:
            hashes[hash_key(self.api_key.encode())] = DEFAULT_KEY_NAME
        return hashes

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            max_connections=self.max_connections,
        )


def hash_key(key: bytes) -> str:
    """What a key is compared as: sha256 of its bytes, lowercase hex."""
    return hashlib.sha256(key).hexdigest()


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses; any other name or address is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
