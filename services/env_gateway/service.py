"""The env-gateway service object: serves every domain's environment and feeds tasks; in a
region (`intake.hub_domain` set) it takes the region's tasks from the hub's queue instead
(libs/region/intake.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.domains.dataset.env import DatasetEnv
from libs.domains.registry import make_env, served_domains
from libs.envs.base import Environment
from libs.envs.feeder import TaskFeeder
from libs.envs.latency import parse_tool_latency, with_tool_latency
from libs.envs.server import EnvServer
from libs.region.intake import TaskIntake
from libs.service import Service
from services.env_gateway.settings import EnvGatewaySettings


class EnvGatewayService(Service):
    """Answers reset/step/close for every domain's env; feeds tasks of `settings.env`."""

    name = "env-gateway"

    def __init__(self, settings: EnvGatewaySettings) -> None:
        super().__init__()
        self.settings = settings
        self.server: EnvServer | None = None
        self.feeder: TaskFeeder | None = None
        self.intake: TaskIntake | None = None

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        s = self.settings
        latency = parse_tool_latency(s.tool_latency)
        envs = {name: with_tool_latency(env, latency, s.seed) for name, env in self._envs().items()}
        if s.env not in envs:
            raise ValueError(f"env {s.env!r} is no domain; known: {', '.join(sorted(envs))}")
        self.server = EnvServer(bus.nc, envs, s.limits)
        if s.feeder.mode != "off":
            source = envs[s.env].task_source(
                difficulty=s.difficulty, group_size=s.group_size, seed=s.seed
            )
            self.feeder = TaskFeeder(
                bus.js,
                Publisher(bus.js),
                source,
                env=s.env,
                config=s.feeder,
                nc=bus.nc,
            )
            await self.feeder.start()
        if s.intake.hub_domain:
            self.intake = TaskIntake(bus, s.intake)
            await self.intake.start()
        await self.server.start()
        self.status = "ok"
        tasks = f"feeder {s.feeder.mode}"
        if self.intake is not None:
            tasks = f"tasks from domain {s.intake.hub_domain}'s queue"
        self.detail = f"serving {', '.join(sorted(envs))}; {tasks}"

    def _envs(self) -> dict[str, Environment]:
        """An environment of every domain served here; the dataset one serves the configured
        file."""
        envs = {name: make_env(name) for name in served_domains()}
        dataset = self.settings.dataset_config()
        if dataset is not None:
            envs[DatasetEnv.name] = DatasetEnv(dataset)
        return envs

    async def run(self) -> None:
        assert self.server is not None, "start() first"
        jobs = [self.server.run()] + ([self.feeder.run()] if self.feeder else [])
        jobs += [self.intake.run()] if self.intake else []
        await asyncio.gather(*jobs)

    async def stop(self) -> None:
        await super().stop()
        if self.feeder is not None:
            self.feeder.stop()
        if self.intake is not None:
            self.intake.stop()
        if self.server is not None:
            await self.server.stop()

    def health(self) -> dict[str, Any]:
        return {
            **super().health(),
            "episodes_open": len(self.server.episodes) if self.server else 0,
            "tasks_published": self.feeder.num_published if self.feeder else 0,
            "feeder_mode": self.settings.feeder.mode,
            "next_task_index": self.feeder.state.next_index if self.feeder else 0,
            **(self._intake_health() if self.intake else {}),
        }

    def _intake_health(self) -> dict[str, Any]:
        assert self.intake is not None
        return {
            "intake_tasks_taken": self.intake.num_taken,
            "intake_tasks_buffered": self.intake.num_buffered,
            "intake_hub_link_up": self.intake.link_up,
        }
