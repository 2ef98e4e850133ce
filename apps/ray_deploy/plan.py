"""What a Ray deployment places, and the rule that sizes the rollout tier (no Ray import).

    plan = build_plan(nats_url, run_dir, gpus={"trainer": 1, "rollout-worker": 1})
    desired_workers(plan.scale, current=2, pending=300, drained_polls=0)   # -> 4 (or max)

Each service is one process (`python -m services.<name>`) in a Ray actor that asks for the
service's resources: GPUs for the trainer and the rollout-workers when given, CPUs for all.
A trainer of N ranks is torchrun in its actor, N processes on that actor's node (the actor
asks for N times the per-rank CPUs and GPUs; libs/trainer/ranks.py).
The trainer and the weight-broadcaster share a node (a STRICT_PACK placement group): the
broadcaster reads the versions the trainer stages in its run folder. The rollout-workers
grow with the task backlog (the JetStream consumer's pending count) and shrink one at a time
once it has stayed drained.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.trainer.launch import trainer_command
from proto.services import SERVICES, service_module

WORKER = "rollout-worker"
# Placed together on one node: the broadcaster reads the trainer's staged weights from disk.
TRAINER_GROUP = ("trainer", "weight-broadcaster")
# A CPU each for the model processes; the bus-bound services need little.
DEFAULT_CPUS = {"trainer": 1.0, WORKER: 1.0}
LIGHT_CPUS = 0.25


@dataclass(frozen=True)
class ServicePlan:
    """One service: its resource request and the variables it runs with."""

    name: str
    num_cpus: float
    num_gpus: float = 0.0
    env: Mapping[str, str] = field(default_factory=dict)
    # Processes of the service (the trainer only: its ranks under torchrun, on one node).
    ranks: int = 1

    @property
    def module(self) -> str:
        return service_module(self.name)

    @property
    def command(self) -> list[str]:
        """argv of the service's process, in the interpreter running this."""
        if self.name == "trainer":
            return trainer_command(self.ranks)
        return [sys.executable, "-m", self.module]

    @property
    def env_prefix(self) -> str:
        return f"RLPIPE_{self.name.upper().replace('-', '_')}_"


@dataclass(frozen=True)
class ScalePolicy:
    """Bounds and pace of the rollout tier."""

    min_workers: int = 1
    max_workers: int = 4
    # Task backlog one worker is expected to work through; above it another is added.
    tasks_per_worker: int = 64
    # Polls in a row with a smaller need before one worker is removed (no flapping).
    shrink_after_polls: int = 3
    poll_s: float = 2.0
    # Time a removed worker gets to finish its episodes; the rest are handed back (nak).
    drain_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"rollout-workers: need 0 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )
        if self.tasks_per_worker < 1:
            raise ValueError(f"tasks_per_worker must be >= 1 (got {self.tasks_per_worker})")


@dataclass(frozen=True)
class DeploymentPlan:
    """Everything the controller needs to place and keep the services."""

    nats_url: str
    run_dir: str
    services: tuple[ServicePlan, ...]
    scale: ScalePolicy = field(default_factory=ScalePolicy)
    # Restarts Ray gives each actor (-1: without limit).
    max_restarts: int = -1
    stop_grace_s: float = 30.0

    def service(self, name: str) -> ServicePlan:
        return next(s for s in self.services if s.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.services)


def desired_workers(policy: ScalePolicy, current: int, pending: int, drained_polls: int) -> int:
    """How many rollout-workers there should be: grow at once to cover the backlog, shrink by
    one only after `shrink_after_polls` polls in a row that needed fewer; within bounds."""
    low, high = policy.min_workers, policy.max_workers
    if not low <= current <= high:  # the bounds changed (`rlpipe ray scale`)
        return min(max(current, low), high)
    need = min(max(math.ceil(pending / policy.tasks_per_worker), low), high)
    if need > current:
        return need
    if need < current and drained_polls >= policy.shrink_after_polls:
        return current - 1
    return current


def build_plan(
    nats_url: str,
    run_dir: str,
    *,
    services: tuple[str, ...] = SERVICES,
    cpus: Mapping[str, float] | None = None,
    gpus: Mapping[str, float] | None = None,
    env: Mapping[str, str] | None = None,
    nats_replicas: int = 1,
    scale: ScalePolicy | None = None,
    trainer_ranks: int = 1,
) -> DeploymentPlan:
    """The plan for `services`; `env` (and every RLPIPE_* variable of this process, which it
    overrides) reaches every service. The trainer's `cpus` and `gpus` are per rank: its
    actor asks for `trainer_ranks` times them on one node and runs torchrun there."""
    if trainer_ranks < 1:
        raise ValueError(f"trainer ranks must be >= 1 (got {trainer_ranks})")
    cpus, gpus = dict(cpus or {}), dict(gpus or {})
    unknown = sorted((set(services) | set(cpus) | set(gpus)) - set(SERVICES))
    if unknown:
        raise ValueError(f"unknown services {unknown}; choose from {', '.join(SERVICES)}")
    shared = {
        **{k: v for k, v in os.environ.items() if k.startswith("RLPIPE_")},
        **(env or {}),
        "RLPIPE_NATS_URL": nats_url,
        "RLPIPE_NATS_REPLICAS": str(nats_replicas),
        "RLPIPE_RUN_DIR": run_dir,
        "RLPIPE_LOG_FORMAT": "json",
        "PYTHONUNBUFFERED": "1",
    }
    plans = tuple(
        ServicePlan(
            name=name,
            num_cpus=cpus.get(name, DEFAULT_CPUS.get(name, LIGHT_CPUS))
            * _ranks(name, trainer_ranks),
            num_gpus=gpus.get(name, 0.0) * _ranks(name, trainer_ranks),
            env=shared,
            ranks=_ranks(name, trainer_ranks),
        )
        for name in SERVICES
        if name in services
    )
    return DeploymentPlan(nats_url, run_dir, plans, scale or ScalePolicy())


def _ranks(name: str, trainer_ranks: int) -> int:
    return trainer_ranks if name == "trainer" else 1


def parse_assignments(items: list[str] | None, what: str) -> dict[str, str]:
    """`["trainer=1", "reward=0.5"]` -> {"trainer": "1", "reward": "0.5"}; names the bad one."""
    parsed: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected NAME=VALUE, got {item!r}")
        parsed[key.strip()] = value.strip()
    return parsed
