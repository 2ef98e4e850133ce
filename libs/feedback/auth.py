"""API keys for the feedback API: stored as SHA-256 hashes, each allowed a set of products.

A key is a random secret the ingester never stores: the config holds `sha256(key)` in hex,
the key's name (for logs and rate limits) and the products it may post feedback for (`*`
for all). Keys are high-entropy random strings (`new_api_key`), so a fast hash is enough:
there is nothing to brute-force that a slow password hash would protect.

Create a key and its config entry with `rlpipe feedback-key` (apps/feedback_key_cli.py):

    export RLPIPE_FEEDBACK_INGESTER_API_KEYS=$(rlpipe feedback-key \
        --name acme-web --products acme,acme-beta --key-out acme-web.key)

Entries come from the service settings (`api_keys`, JSON in the environment) and/or a
secret file (`api_keys_file`, TOML or JSON):

    [[keys]]
    name = "acme-web"
    sha256 = "9f86d0..."
    products = ["acme"]
"""

from __future__ import annotations

import hashlib
import json
import secrets
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

ALL_PRODUCTS = "*"
KEY_PREFIX = "rlfb_"


class ApiKeyEntry(BaseModel):
    """One API key as configured: its name, the hash of the secret, and its products."""

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Who holds the key (letters, digits, '-', '_'): stored with every event it "
        "posts, the name its rate limit and sample budget are kept under",
    )
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the key, lowercase hex")
    products: list[str] = Field(
        min_length=1, description="Products the key may post feedback for; '*' for all"
    )


# A key's id: the first hex digits of its sha256, stored with every event it posts, so two
# keys of one holder (a rotation) can be told apart and the leaked one purged alone.
KEY_ID_HEX_DIGITS = 12


@dataclass(frozen=True)
class Principal:
    """The holder of a valid key: its name, the products it may rate, the key's id."""

    name: str
    products: frozenset[str]
    key_id: str = ""

    def may_post_for(self, product: str) -> bool:
        return ALL_PRODUCTS in self.products or product in self.products


def hash_key(key: str) -> str:
    """The stored form of a key: sha256 of its UTF-8 bytes, lowercase hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(sha256: str) -> str:
    """The id of the key with this stored hash."""
    return sha256[:KEY_ID_HEX_DIGITS]


def new_api_key() -> str:
    """A fresh key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    """Looks up the principal of a presented key by its hash."""

    def __init__(self, entries: Iterable[ApiKeyEntry]) -> None:
        self._by_hash: dict[str, Principal] = {}
        for entry in entries:
            if entry.sha256 in self._by_hash:
                raise ValueError(f"API key {entry.name!r}: the same key hash is configured twice")
            self._by_hash[entry.sha256] = Principal(
                entry.name, frozenset(entry.products), key_id(entry.sha256)
            )

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, key: str) -> Principal | None:
        """The key's principal, or None for an unknown key.

        The dict lookup is on the hash of the presented key, which the caller cannot steer,
        so its timing reveals nothing useful about stored hashes.
        """
        return self._by_hash.get(hash_key(key))


def load_key_file(path: Path) -> list[ApiKeyEntry]:
    """Entries from a TOML or JSON file with a `keys` list; raises naming the file and field."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"api_keys_file {path}: cannot read it ({exc})") from exc
    try:
        document = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(
            f"api_keys_file {path}: not valid {path.suffix or 'TOML'} ({exc})"
        ) from exc
    raw_keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(raw_keys, list):
        raise ValueError(f"api_keys_file {path}: expected a `keys` list of tables")
    try:
        return [ApiKeyEntry.model_validate(raw) for raw in raw_keys]
    except ValidationError as exc:
        raise ValueError(f"api_keys_file {path}: {exc}") from exc


def build_key_store(entries: Iterable[ApiKeyEntry], key_file: Path | None) -> KeyStore:
    """Keys from settings plus those of the secret file, if any."""
    all_entries = list(entries)
    if key_file is not None:
        all_entries += load_key_file(key_file)
    return KeyStore(all_entries)
