"""`rlpipe region`: a region that keeps working on its own server (libs/region, docs/regions.md).

    rlpipe region setup --hub-domain hub --nats-url nats://relay:PW@region-nats:4222
        on the REGIONAL server, as its relay: mirrors of the weights and the trainer's state,
        the region's work queue and its outboxes (idempotent)
    rlpipe region hub-setup --regions region-a --nats-url nats://admin:PW@hub:4222
        on the HUB, as the admin: its rollout and dead-letter streams source each region's
        outboxes (idempotent; after `rlpipe provision`)
    rlpipe region status --nats-url nats://relay:PW@region-nats:4222
        what the region holds: tasks buffered, rollouts in its outbox, how far its mirrors lag

The user may come with the URL or from RLPIPE_NATS_USER / RLPIPE_NATS_PASSWORD (and TLS
from RLPIPE_NATS_TLS_*), as for `rlpipe provision`. A bus problem exits 2 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable

import nats.errors

from libs.bus.connection import Bus
from libs.bus.provision import ProvisionReport
from proto.regions import HUB_DOMAIN, REGIONS


def add_region_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "region", help="set up a region that keeps working through a link outage"
    )
    actions = parser.add_subparsers(dest="region_command", required=True)
    default_url = os.environ.get("RLPIPE_NATS_URL", "nats://127.0.0.1:4222")
    setup = actions.add_parser("setup", help="on a region's server: mirrors, queue, outboxes")
    setup.add_argument("--hub-domain", default=HUB_DOMAIN, help="the hub's JetStream domain")
    setup.add_argument("--nats-url", default=default_url, help="the REGIONAL server")
    hub = actions.add_parser("hub-setup", help="on the hub: source the regions' outboxes")
    hub.add_argument(
        "--regions",
        default=",".join(REGIONS),
        help="regions (their JetStream domains), comma-separated",
    )
    hub.add_argument("--nats-url", default=default_url, help="the HUB's server")
    status = actions.add_parser("status", help="what a region's server holds, as JSON")
    status.add_argument("--nats-url", default=default_url, help="the REGIONAL server")


def run(args: argparse.Namespace) -> int:
    from libs.region.hub import source_regions
    from libs.region.setup import region_status, setup_region

    if args.region_command == "setup":
        return _run(args.nats_url, "rlpipe-region-setup",
                    lambda bus: _report(setup_region(bus.js, args.hub_domain)))  # fmt: skip
    if args.region_command == "hub-setup":
        regions = tuple(r.strip() for r in args.regions.split(",") if r.strip())
        return _run(args.nats_url, "rlpipe-region-hub-setup",
                    lambda bus: _report(source_regions(bus.js, regions)))  # fmt: skip

    async def status(bus: Bus) -> None:
        print(json.dumps(await region_status(bus.js), indent=2))

    return _run(args.nats_url, "rlpipe-region-status", status)


async def _report(work: Awaitable[ProvisionReport]) -> None:
    report = await work
    for name, outcome in report.outcomes.items():
        print(f"{outcome:>9}  {name}")


def _run(url: str, name: str, work: Callable[[Bus], Awaitable[None]]) -> int:
    from libs.bus.connection import BusConnectError, connect_bus, options_from_environment
    from libs.bus.provision import ProvisionError
    from libs.logs import configure_logging

    configure_logging(name, level="warning")

    async def main() -> None:
        bus = await connect_bus(url, name=name, options=options_from_environment(os.environ))
        try:
            await work(bus)
        finally:
            await bus.close()

    try:
        asyncio.run(main())
    except (BusConnectError, ProvisionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (nats.errors.Error, TimeoutError) as exc:  # a refusal (permissions) or no answer
        print(f"error: the server did not do it ({exc!r}): check the URL and the user",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
