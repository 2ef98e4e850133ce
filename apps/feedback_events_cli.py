"""`rlpipe feedback-events`: list, or purge, what one feedback API key sent.

    rlpipe feedback-events list --key acme-web              # every key named acme-web
    rlpipe feedback-events list --key acme-web:9f86d081884c # one key (its id: sha256[:12])
    rlpipe feedback-events purge --key acme-web:9f86d081884c

It reads (and purge deletes) the key's events in the feedback stream, the join's waiting
events, the online samples not yet trained on and the join's dead letters. It connects as
the admin, as `rlpipe provision` does (RLPIPE_NATS_URL, RLPIPE_NATS_USER/PASSWORD, TLS
variables). Revoke the key first (remove its entry from the ingester's keys), then purge.
The work is libs/feedback/purge.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from libs.bus.connection import BusConnectError, connect_bus, options_from_environment
from libs.bus.provision import ProvisionError
from libs.feedback.purge import KeyEvents, KeySelector, find_key_events, purge_key_events


def add_feedback_events_parser(commands: argparse._SubParsersAction) -> None:
    """Register `feedback-events` on an argparse subparsers object."""
    parser = commands.add_parser(
        "feedback-events",
        help="list or purge the feedback events one API key sent",
        description="Find what one feedback API key sent, in the feedback stream, the join's "
        "waiting events, the online samples and the join's dead letters; purge deletes them.",
    )
    parser.add_argument("action", choices=("list", "purge"))
    parser.add_argument(
        "--key", required=True, help="NAME (every key of that name) or NAME:KEY_ID (one key)"
    )
    parser.add_argument(
        "--nats-url", default=os.environ.get("RLPIPE_NATS_URL", "nats://127.0.0.1:4222")
    )


def run(args: argparse.Namespace) -> int:
    try:
        selector = KeySelector.parse(args.key)
        found = asyncio.run(_run(args.action, selector, args.nats_url))
    except (ValueError, BusConnectError, ProvisionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(args.action, selector, found))
    return 0


async def _run(action: str, selector: KeySelector, url: str) -> KeyEvents:
    options = options_from_environment(os.environ)  # as the admin, like `rlpipe provision`
    bus = await connect_bus(url, name="rlpipe-feedback-events", options=options)
    try:
        if action == "purge":
            return await purge_key_events(bus.js, selector)
        return await find_key_events(bus.js, selector)
    finally:
        await bus.close()


def report(action: str, selector: KeySelector, found: KeyEvents) -> str:
    """What was found (or deleted), one place a line."""
    verb = "deleted" if action == "purge" else "found"
    lines = [f"key {selector}: {verb} {found.total} stored copies of its events"]
    lines += [f"  {place:<13} {count}" for place, count in found.counts().items()]
    if found.products:
        products = ", ".join(f"{p} ({n})" for p, n in found.products.most_common())
        key_ids = ", ".join(f"{k or '-'} ({n})" for k, n in found.key_ids.most_common())
        lines.append(f"  products      {products}")
        lines.append(f"  key ids       {key_ids}")
        lines.append(f"  received      {_time(found.first_received_at)} .. "
                     f"{_time(found.last_received_at)}")  # fmt: skip
    return "\n".join(lines)


def _time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_s)) + " UTC"
