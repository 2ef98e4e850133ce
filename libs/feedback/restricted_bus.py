"""A bus connection for a user that may only publish feedback (deploy/nats/auth.conf).

Such a user cannot call the JetStream API (`$JS.API.>` is denied: no stream info, no
provisioning) and may subscribe only to its own inbox prefix, where the streams' PubAcks
arrive. nats-py puts every reply inbox under `inbox_prefix`, so the connection must use the
prefix the server config allows.
"""

from __future__ import annotations

from libs.bus.connection import Bus, BusConnectError, NatsOptions, connect_bus

DEFAULT_INBOX_PREFIX = "_INBOX_feedback_api"


async def connect_restricted_bus(
    url: str,
    name: str,
    inbox_prefix: str = DEFAULT_INBOX_PREFIX,
    connect_timeout_s: float = 2.0,
    tls: NatsOptions | None = None,
) -> Bus:
    """Connect with credentials in `url` (nats://user:password@host:port); one attempt, then
    nats-py reconnects on its own. `tls`: the TLS fields of the service's own options."""
    try:
        return await connect_bus(
            url,
            name,
            max_attempts=1,
            connect_timeout_s=connect_timeout_s,
            inbox_prefix=inbox_prefix,
            options=tls,
        )
    except BusConnectError as exc:
        raise BusConnectError(
            f"feedback publisher: {exc}; check RLPIPE_FEEDBACK_INGESTER_API_NATS_URL "
            "(user, password, host)"
        ) from exc
