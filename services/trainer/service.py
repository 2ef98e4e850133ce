"""The trainer service: the trainer loop (libs.trainer) behind the service lifecycle."""

from __future__ import annotations

from typing import Any

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.service import Service
from libs.trainer.loop import Trainer
from services.trainer.settings import TrainerSettings


class TrainerService(Service):
    name = "trainer"

    def __init__(self, settings: TrainerSettings) -> None:
        super().__init__()
        self.settings = settings
        self.trainer: Trainer | None = None

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        # The settings are the loop's config as is (TrainerSettings is a TrainerConfig).
        # Under torchrun (WORLD_SIZE > 1) this is rank 0 of the sharded trainer.
        self.trainer = Trainer(self.settings, self.settings.run_dir, bus, Publisher(bus.js))
        await self.trainer.setup()

    async def run(self) -> None:
        assert self.trainer is not None, "start() first"
        await self.trainer.run()

    async def stop(self) -> None:
        await super().stop()
        if self.trainer is not None:
            await self.trainer.stop()

    def health(self) -> dict[str, Any]:
        if self.trainer is None:
            return super().health()
        return {"service": self.name, **self.trainer.health()}
