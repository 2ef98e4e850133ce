"""A worker stops even when a same-host notice arrives as it is cancelled: waiting for the
next notice must not swallow the cancel (Python 3.11's asyncio.wait_for returns the result
when a cancel comes as the wait ends; the worker then never exited on SIGTERM)."""

from __future__ import annotations

import asyncio

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.weights.same_host_link import SameHostTakeConfig, SameHostTaker
from libs.weights.signing import VersionVerifier
from tests.conftest import wait_for


async def test_waiting_for_a_notice_ends_when_cancelled_as_one_arrives(bus: Bus) -> None:
    await provision(bus.js)
    verifier = VersionVerifier.from_config([], allow_unsigned=True)
    taker = SameHostTaker(bus, SameHostTakeConfig(host_id="host-cancel"), verifier)
    waiting = asyncio.create_task(taker.next_notice(after=None))
    await wait_for(lambda: bool(taker._arrived._waiters))

    taker._arrived.set()  # a notice's wake-up and the worker's stop in the same loop turn
    waiting.cancel()
    done, _ = await asyncio.wait({waiting}, timeout=30)  # against a hang only
    assert waiting in done and waiting.cancelled()
