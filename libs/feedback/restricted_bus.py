"""A bus connection for a user that may only publish feedback (deploy/nats/auth.conf).

Such a user cannot call the JetStream API (`$JS.API.>` is denied: no stream info, no
provisioning) and may subscribe only to its own inbox prefix, where the streams' PubAcks
arrive. nats-py puts every reply inbox under `inbox_prefix`, so the connection must use the
prefix the server config allows.
"""

from __future__ import annotations

import asyncio

import nats
import structlog

from libs.bus.connection import Bus, BusConnectError, check_server_version

log = structlog.get_logger(__name__)

DEFAULT_INBOX_PREFIX = "_INBOX_feedback_api"


async def connect_restricted_bus(
    url: str,
    name: str,
    inbox_prefix: str = DEFAULT_INBOX_PREFIX,
    connect_timeout_s: float = 2.0,
) -> Bus:
    """Connect with credentials in `url` (nats://user:password@host:port); one attempt, then
    nats-py reconnects on its own."""
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                name=name,
                inbox_prefix=inbox_prefix,
                connect_timeout=connect_timeout_s,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=_on_error,
            ),
            timeout=connect_timeout_s * 2,
        )
    except Exception as exc:  # nats raises several unrelated types for "unreachable"
        raise BusConnectError(
            f"feedback publisher could not connect to NATS ({exc!r}); check "
            "RLPIPE_FEEDBACK_INGESTER_API_NATS_URL (user, password, host)"
        ) from exc
    try:
        check_server_version(str(nc.connected_server_version), "the feedback publisher's URL")
    except BusConnectError:
        await nc.close()
        raise
    return Bus(nc=nc, js=nc.jetstream())


async def _on_error(exc: Exception) -> None:
    log.warning("feedback publisher bus error", error=repr(exc))
