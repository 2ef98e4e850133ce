"""The deployment's controller: a detached Ray actor that places the services, keeps the
rollout tier sized to the task backlog, and answers status.

    controller = deploy(plan)                       # named "rlpipe-controller", detached
    ray.get(controller.status.remote())             # every actor, backlog, bounds, events
    ray.get(controller.set_bounds.remote(2, 6))     # rollout-workers between 2 and 6
    ray.get(controller.shutdown.remote())           # workers drain first, then the rest

Each service is a ServiceProcess actor, named `rlpipe-<service>` (workers
`rlpipe-rollout-worker-<i>`), detached and restarted by Ray on failure. The trainer and the
weight-broadcaster go into one STRICT_PACK placement group (same node: the broadcaster reads
the trainer's staged weights from its run folder). A thread polls the JetStream consumer the
workers pull tasks from (`num_pending`: tasks not yet delivered) every `poll_s`: a backlog
above `tasks_per_worker` per worker adds workers at once; one that stays smaller removes
the newest worker, which drains (SIGTERM: it stops pulling, finishes its episodes or hands
them back) before its actor is ended. Actors are created with `get_if_exists`, so a
restarted controller adopts the ones already running. NATS carries all the work; Ray only
places processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Any

import ray
import structlog
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from apps.ray_deploy.plan import (
    TRAINER_GROUP,
    WORKER,
    DeploymentPlan,
    ScalePolicy,
    ServicePlan,
    desired_workers,
)
from apps.ray_deploy.service_actor import ServiceProcess
from libs.bus.connection import Bus, connect_bus
from proto.streams import ROLLOUT_WORKER_TASKS

log = structlog.get_logger(__name__)

NAMESPACE = "rlpipe"
CONTROLLER_NAME = "rlpipe-controller"
PLACEMENT_GROUP_NAME = "rlpipe-trainer-node"
MAX_EVENTS = 50
STATUS_TIMEOUT_S = 5.0

ServiceActor = ray.remote(ServiceProcess)


class Controller:
    """The body of the controller actor (see the module docstring)."""

    def __init__(self, plan: DeploymentPlan) -> None:
        self.plan = plan
        self.scale = plan.scale
        self.lock = threading.RLock()
        self.actors: dict[str, Any] = {}  # actor name -> handle
        self.workers: list[str] = []  # worker actor names, oldest first
        self.draining: set[str] = set()
        self.pids: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self.backlog: int | None = None
        self.backlog_error: str | None = None
        self.events: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self._drained_polls = 0
        self._place_services()
        self._loop = threading.Thread(target=self._autoscale_thread, daemon=True)
        self._loop.start()

    # --- placement -------------------------------------------------------------------------

    def _place_services(self) -> None:
        group = self._trainer_group()
        for service in self.plan.services:
            if service.name == WORKER:
                continue
            strategy = None
            if group is not None and service.name in TRAINER_GROUP:
                index = [s for s in TRAINER_GROUP if s in self.plan.names].index(service.name)
                strategy = PlacementGroupSchedulingStrategy(group, index)
            self._start_actor(f"rlpipe-{service.name}", service, strategy)
        if WORKER in self.plan.names:
            self._adopt_workers()
            for _ in range(self.scale.min_workers - len(self.workers)):
                self._add_worker()

    def _adopt_workers(self) -> None:
        """Workers a previous controller left running (this one is a restart)."""
        for index in range(self.scale.max_workers):
            name = f"rlpipe-{WORKER}-{index}"
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
            with self.lock:
                self.workers.append(name)
                self.actors[name] = handle
            self._event("adopted", actor=name)

    def _trainer_group(self) -> PlacementGroup | None:
        members = [self.plan.service(n) for n in TRAINER_GROUP if n in self.plan.names]
        if len(members) < 2:
            return None
        try:
            return get_placement_group(PLACEMENT_GROUP_NAME)
        except ValueError:
            bundles = [_bundle(s) for s in members]
            group = placement_group(
                bundles, strategy="STRICT_PACK", name=PLACEMENT_GROUP_NAME, lifetime="detached"
            )
            ray.get(group.ready(), timeout=300)
            return group

    def _start_actor(self, name: str, service: ServicePlan, strategy: Any = None) -> None:
        options: dict[str, Any] = {
            "name": name,
            "namespace": NAMESPACE,
            "lifetime": "detached",
            "get_if_exists": True,
            "max_restarts": self.plan.max_restarts,
            "num_cpus": service.num_cpus,
            "num_gpus": service.num_gpus,
            # status and stop are answered while the service runs
            "max_concurrency": 4,
        }
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        handle = ServiceActor.options(**options).remote(name, service, self.plan.run_dir)
        with self.lock:
            self.actors[name] = handle
        self._event("placed", actor=name, cpus=service.num_cpus, gpus=service.num_gpus)

    def _add_worker(self) -> None:
        with self.lock:
            taken = set(self.workers) | self.draining
            index = next(i for i in range(len(taken) + 1) if f"rlpipe-{WORKER}-{i}" not in taken)
            name = f"rlpipe-{WORKER}-{index}"
            self.workers.append(name)
        self._start_actor(name, self.plan.service(WORKER))

    def _remove_worker(self) -> None:
        """The newest worker drains (SIGTERM) and its actor ends."""
        with self.lock:
            name = self.workers.pop()
            self.draining.add(name)
        self._event("draining", actor=name)
        code = self._end(name, self.scale.drain_s)
        with self.lock:
            self.draining.discard(name)
        self._event("removed", actor=name, exit=code)

    def _end(self, name: str, grace_s: float) -> int | str | None:
        """Stop the service (SIGTERM, `grace_s` to drain) and end its actor for good."""
        with self.lock:
            handle = self.actors[name]
        code: int | str | None
        try:
            code = ray.get(handle.stop.remote(grace_s), timeout=grace_s + 30)
        except Exception as exc:  # an actor already gone: nothing left to drain
            code = repr(exc)[:200]
        ray.kill(handle, no_restart=True)
        with self.lock:
            self.actors.pop(name, None)
        return code

    # --- scaling ---------------------------------------------------------------------------

    def _autoscale_thread(self) -> None:
        """The polling loop; if it dies, the controller dies loudly and Ray restarts it."""
        try:
            asyncio.run(self._autoscale())
        except BaseException:
            log.exception("autoscaling stopped; restarting the controller")
            os._exit(1)

    async def _autoscale(self) -> None:
        bus: Bus | None = None
        while not self.stopped.is_set():
            try:
                bus = bus or await connect_bus(self.plan.nats_url, name=CONTROLLER_NAME)
                info = await bus.js.consumer_info(
                    ROLLOUT_WORKER_TASKS.stream, ROLLOUT_WORKER_TASKS.durable
                )
            except Exception as exc:  # the bus or the consumer not there yet: next poll
                self._backlog_unknown(repr(exc)[:200])
            else:
                self.backlog, self.backlog_error = int(info.num_pending or 0), None
                await asyncio.to_thread(self._resize, self.backlog)
            await asyncio.to_thread(self.status)  # notes restarts between callers' asks
            await asyncio.sleep(self.scale.poll_s)
        if bus is not None:
            await bus.close()

    def _backlog_unknown(self, error: str) -> None:
        """No backlog this poll: the tier stays as it is; the event once per kind of error."""
        if error != self.backlog_error:
            self._event("backlog unknown", error=error)
        self.backlog, self.backlog_error = None, error

    def _resize(self, pending: int) -> None:
        if WORKER not in self.plan.names or self.stopped.is_set():
            return
        with self.lock:
            current, policy = len(self.workers), self.scale
        self._drained_polls = self._drained_polls + 1 if _fewer(policy, current, pending) else 0
        want = desired_workers(policy, current, pending, self._drained_polls)
        if want > current:
            self._event("growing", backlog=pending, workers=current, to=want)
            for _ in range(want - current):
                self._add_worker()
        elif want < current:
            self._drained_polls = 0
            self._event("shrinking", backlog=pending, workers=current, to=want)
            for _ in range(current - want):
                self._remove_worker()

    def _note_restart(self, entry: dict[str, Any]) -> None:
        """Count an actor's restarts by its service's pid changing."""
        pid, name = entry.get("pid"), entry["actor"]
        if pid is None:
            return
        with self.lock:
            changed = name in self.pids and self.pids[name] != pid
            if changed:
                self.restarts[name] = self.restarts.get(name, 0) + 1
            self.pids[name] = pid
        if changed:
            self._event("restarted", actor=name, pid=pid)

    # --- the actor's methods ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self.lock:  # one consistent view: the events match the actors listed
            actors = dict(self.actors)
            workers, draining = list(self.workers), set(self.draining)
            events = list(self.events[-MAX_EVENTS:])
        refs = {name: handle.status.remote() for name, handle in actors.items()}
        entries = []
        for name, ref in refs.items():
            try:
                entry = ray.get(ref, timeout=STATUS_TIMEOUT_S)
            except Exception as exc:  # restarting, or its node is gone
                entry = {"actor": name, "state": "unavailable", "error": repr(exc)[:200]}
            self._note_restart(entry)
            entry["restarts"] = self.restarts.get(name, 0)
            entry["draining"] = name in draining
            entries.append(entry)
        return {
            "actors": entries,
            "workers": len(workers),
            "min_workers": self.scale.min_workers,
            "max_workers": self.scale.max_workers,
            "backlog": self.backlog,
            "backlog_error": self.backlog_error,
            "events": events,
        }

    def set_bounds(self, min_workers: int, max_workers: int) -> dict[str, int]:
        """New bounds for the rollout-workers; applied at the next poll."""
        self.scale = ScalePolicy(
            min_workers=min_workers,
            max_workers=max_workers,
            tasks_per_worker=self.scale.tasks_per_worker,
            shrink_after_polls=self.scale.shrink_after_polls,
            poll_s=self.scale.poll_s,
            drain_s=self.scale.drain_s,
        )
        self._event("bounds", min=min_workers, max=max_workers)
        return {"min_workers": min_workers, "max_workers": max_workers}

    def shutdown(self) -> list[str]:
        """Drain the workers, then stop the other services in reverse order; end them all."""
        self.stopped.set()
        with self.lock:
            num_workers = len(self.workers)
        for _ in range(num_workers):
            self._remove_worker()
        with self.lock:
            rest = [n for n in reversed(list(self.actors)) if n not in self.draining]
        for name in rest:
            self._event("stopped", actor=name, exit=self._end(name, self.plan.stop_grace_s))
        with contextlib.suppress(ValueError):  # no placement group: nothing to remove
            remove_placement_group(get_placement_group(PLACEMENT_GROUP_NAME))
        return rest

    def _event(self, what: str, **fields: Any) -> None:
        entry = {"time": round(time.time(), 2), "event": what, **fields}
        with self.lock:
            self.events = [*self.events[-MAX_EVENTS + 1 :], entry]
        log.info(what, **fields)


def _fewer(policy: ScalePolicy, current: int, pending: int) -> bool:
    """Whether this poll's backlog needs fewer workers than there are."""
    return desired_workers(policy, current, pending, policy.shrink_after_polls) < current


def _bundle(service: ServicePlan) -> dict[str, float]:
    bundle = {"CPU": service.num_cpus}
    if service.num_gpus:
        bundle["GPU"] = service.num_gpus
    return bundle


ControllerActor = ray.remote(Controller)


def deploy(plan: DeploymentPlan) -> Any:
    """Start (or find) the controller for `plan` on the connected Ray cluster."""
    return ControllerActor.options(
        name=CONTROLLER_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=8,
        num_cpus=0,
    ).remote(plan)


def find_controller() -> Any:
    """The running deployment's controller; ValueError when there is none."""
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
