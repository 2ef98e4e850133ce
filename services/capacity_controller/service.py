"""The capacity controller service: watches the serving fleet, lends and recalls replicas.

Lifecycle: `start` provisions nothing of its own (the fleet bucket and the decisions stream
are provisioned with the rest) and builds the controller (libs/fleet/controller.py); `run`
decides every `tick_s` until stopped; `stop` ends the loop between two ticks (a command in
flight gets its answer and is recorded first).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from libs.bus.connection import Bus
from libs.fleet.controller import CapacityController
from libs.service import Service
from services.capacity_controller.settings import CapacityControllerSettings

log = structlog.get_logger(__name__)


class CapacityControllerService(Service):
    """Keeps `fleet.headroom` serving and lends the rest of the serve replicas to RL."""

    name = "capacity-controller"

    def __init__(self, settings: CapacityControllerSettings) -> None:
        super().__init__()
        self.settings = settings
        self.controller: CapacityController | None = None
        self._stopping = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        s = self.settings
        self.controller = CapacityController(
            s.fleet,
            bus,
            stale_s=s.stale_s,
            settle_s=s.settle_s,
            command_timeout_s=s.command_timeout_s,
        )
        self.status = "ok"
        self.detail = "watching the serving fleet"

    async def run(self) -> None:
        assert self.controller is not None, "start() first"
        while not self._stopping.is_set():
            plan = await self.controller.tick()
            self.detail = (
                f"{plan.num_serving} serving of {plan.num_needed} needed, {plan.num_lent} lent"
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.settings.tick_s)

    async def stop(self) -> None:
        await super().stop()
        self._stopping.set()

    def health(self) -> dict[str, Any]:
        report = super().health()
        return {**report, **(self.controller.health() if self.controller else {})}
