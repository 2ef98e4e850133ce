"""`rlpipe demo`: a NATS server, the bus, and every service on this machine, supervised.

    python -m apps.cli demo                     # until Ctrl-C
    python -m apps.cli demo --duration-s 60     # a bounded run for scripts
    python -m apps.cli demo --env calc          # tool use: warm start (SFT), then RL
    python -m apps.cli demo --dataset rows.jsonl   # your prompts and answers as tasks
    python -m apps.cli demo --nats-cluster 3    # the bus as a 3-node JetStream cluster
    python -m apps.cli demo --trainer-ranks 2   # the trainer sharded over 2 processes

Everything lives in the run folder (`runs/<UTC timestamp>/` unless `--run-dir`):
`nats/` (JetStream store; `nats/n1`, `nats/n2`, ... for a cluster, every stream and bucket
then replicated on 3 nodes), `logs/<service>.log`, `pids.json` (every pid started, for
leak checks), `summary.json` and `report/` (plots, apps.report). The run ends by printing
a summary for a person (apps.launcher.summary); when stdout is not a terminal, the JSON
summary is also its last line there (the human one goes to stderr). For a tool
environment it holds task success, reward, tool-call validity and turns per episode of the
first and last trainer steps (apps.launcher.episode_report).

The run's recipe (apps.launcher.recipe: `--recipe FILE`, else the domain's
libs/domains/<name>/recipe.toml) is written to the run folder as `recipe.toml` and handed to
every service through RLPIPE_CONFIG; a file you name in RLPIPE_CONFIG is layered over it, and
variables set in the environment and `--set` win over both. A recipe with a `[warm_start]`
(calc, recall) starts the policy from its warm start (apps.launcher.warm_start: demonstrations
-> SFT, built once and cached) unless `--no-warm-start`.

Exit codes: 0 after a bounded stop with every service seen healthy, or after Ctrl-C /
SIGTERM; 2 when NATS did not start, or died and could not be restarted on its data folder
(apps.launcher.nats_watch restarts it; the services ride through); 3 when a service never
became healthy; 4 when provisioning the bus failed; 130 when a second Ctrl-C forced everything down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.launcher.episode_report import episode_report
from apps.launcher.harness import harness_tables
from apps.launcher.health import HealthMonitor
from apps.launcher.layout import instance_name, worker_device
from apps.launcher.nats_watch import NatsWatch
from apps.launcher.recipe import (
    RECIPE_FILE,
    WarmStart,
    merge_tables,
    run_recipe,
    write_recipe,
)
from apps.launcher.secure_bus import SecureBus
from apps.launcher.status_view import Bound, LauncherLog, StatusView
from apps.launcher.summary import build_summary, print_summary
from apps.launcher.supervisor import Backoff, ChildSpec, Supervisor
from apps.launcher.weight_keys import signing_environment
from libs.nats_server import NatsCluster, NatsServer, free_port
from libs.settings import CONFIG_VARIABLE, OVERRIDES_VARIABLE
from proto.services import SERVICES

if TYPE_CHECKING:
    from libs.bus.connection import NatsOptions

EXIT_OK, EXIT_NATS_FAILED, EXIT_UNHEALTHY, EXIT_PROVISION_FAILED = 0, 2, 3, 4
EXIT_FORCED = 130
# Services stopped (and waited for) before the others (each of their instances).
STOP_FIRST = ("rollout-worker",)
TICK_S = 0.25


@dataclass
class LaunchOptions:
    """One local run. `services` and `commands` use the dashed service names."""

    run_dir: Path | None = None
    duration_s: float | None = None
    max_trainer_steps: int | None = None
    services: Sequence[str] = SERVICES
    # The services' tables of the run's recipe (apps.launcher.recipe), as TOML reads them.
    recipe: Mapping[str, Any] = field(default_factory=dict)
    # Command per service instead of `python -m services.<pkg>` (a profiler, a stand-in).
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)
    provision: bool = True
    healthy_timeout_s: float = 180.0
    # A service that crashed this many times without ever answering healthy ends the run.
    max_restarts_unhealthy: int = 5
    stop_grace_s: float = 60.0  # a worker's drain (2 x drain_timeout_s) and exit, on busy cores
    backoff: Backoff = field(default_factory=Backoff)
    # The warm start the trainer and workers load (built when missing).
    warm_start: WarmStart | None = None
    warm_start_root: Path | None = None  # None: warm_start.default_cache_root()
    # Nodes of the local NATS: 1 (one nats-server) or a JetStream cluster of 3 or more.
    nats_cluster: int = 1
    # Rollout-worker processes, each with the same settings: "rollout-worker", then
    # "rollout-worker-2", ... (their own health port, logs and worker id; one task stream).
    rollout_workers: int = 1
    # One rollout-worker per device, each on its own (its policy.device): the layout's
    # worker cards. Empty: `rollout_workers` workers on the recipe's device.
    worker_devices: tuple[str, ...] = ()
    # A user per role from proto/permissions.py, passwords made for the run (secure_bus.py
    # says why this is the default); `tls` adds a CA made for the run and client certificates.
    secure_bus: bool = True
    tls: bool = False

    def __post_init__(self) -> None:
        if self.tls and not self.secure_bus:
            raise ValueError("tls needs the secured bus: drop --open-bus or --tls")
        if self.nats_cluster == 2 or self.nats_cluster < 1:
            raise ValueError(
                f"nats_cluster must be 1 or at least 3 (got {self.nats_cluster}): a cluster "
                "of 2 loses its Raft quorum when either node dies"
            )
        unknown = sorted(set(self.services) - set(SERVICES))
        if unknown:
            raise ValueError(f"services: unknown {unknown}; choose from {', '.join(SERVICES)}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(
                f"duration_s must be > 0 (got {self.duration_s}); omit it to run until Ctrl-C"
            )
        if self.max_trainer_steps is not None and self.max_trainer_steps < 1:
            raise ValueError(f"max_trainer_steps must be >= 1 (got {self.max_trainer_steps})")
        if self.rollout_workers < 1:
            raise ValueError(f"rollout_workers must be >= 1 (got {self.rollout_workers})")
        if self.worker_devices and self.rollout_workers not in (1, len(self.worker_devices)):
            raise ValueError(
                f"rollout_workers {self.rollout_workers} and {len(self.worker_devices)} worker "
                "devices: a worker runs on each device; give one or the other"
            )

    def stopped_first(self) -> list[str]:
        """The instances of the STOP_FIRST services."""
        return [name for name, service in self.instances() if service in STOP_FIRST]

    def instances(self) -> list[tuple[str, str]]:
        """(instance name, service) of every process the run starts: the services, with
        `rollout_workers` instances of the rollout-worker."""
        pairs = []
        workers = len(self.worker_devices) or self.rollout_workers
        for service in self.services:
            copies = workers if service == "rollout-worker" else 1
            pairs += [(instance_name(service, i), service) for i in range(copies)]
        return pairs


def with_warm_start(options: LaunchOptions, log: LauncherLog) -> LaunchOptions:
    """`options` with the trainer and workers loading the warm-start policy (built first when
    missing) and the workers' harness set for its domain."""
    if options.warm_start is None:
        return options
    # Imported here: the warm start pulls in torch and transformers (seconds of CPU).
    from apps.launcher import warm_start

    env, root = options.warm_start.env, options.warm_start_root
    root = root or warm_start.default_cache_root()
    path = warm_start.ensure_warm_start(env, root, options.warm_start.recipe, emit=log.info)
    tables = merge_tables(options.recipe, warm_start.policy_tables(path))
    return replace(options, recipe=tables)


def with_harness(options: LaunchOptions) -> LaunchOptions:
    """`options` with the workers under the harness limits of the recipe's domain
    (apps.launcher.harness), unless no worker of the launcher's own is started."""
    if "rollout-worker" not in options.services or "rollout-worker" in options.commands:
        return options
    tables = merge_tables(options.recipe, harness_tables(options.recipe))
    return replace(options, recipe=tables)


def run_local(options: LaunchOptions) -> int:
    """Run everything until Ctrl-C/SIGTERM or a bound; print the summary; return the exit code."""
    log = LauncherLog()
    if options.warm_start:
        cache = options.warm_start_root or "the default cache"
        log.info("warm start", env=options.warm_start.env, cache=str(cache))
    options = with_harness(with_warm_start(options, log))
    return asyncio.run(LocalRun(options, log).run())


def nats_replicas(options: LaunchOptions) -> int:
    """The replication of streams and buckets: 1 on one server, 3 on a cluster."""
    return 1 if options.nats_cluster == 1 else min(3, options.nats_cluster)


def final_trainer_step(run_dir: Path, seen: int | None) -> int | None:
    """The trainer's last step: its final checkpoint's when later than the last health check
    (a trainer that reached its bound checkpoints and exits between two checks)."""
    from libs.trainer.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir / "trainer" / "checkpoints")
    if checkpoint is None:
        return seen
    return max(checkpoint.state.step, seen or 0)


def default_run_dir() -> Path:
    return Path("runs") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def service_spec(
    name: str,
    options: LaunchOptions,
    nats_url: str,
    run_dir: Path,
    instance: str | None = None,
    bus_env: Mapping[str, str] | None = None,
) -> tuple[ChildSpec, str]:
    """How to start one service (as `instance`, default its own name), and the URL of its
    health check. `bus_env`: its identity on a secured bus (SecureBus.service_environment)."""
    pkg = name.replace("-", "_")
    prefix, port = f"RLPIPE_{pkg.upper()}", free_port()
    env = {
        "RLPIPE_NATS_URL": nats_url,
        "RLPIPE_NATS_REPLICAS": str(nats_replicas(options)),
        "RLPIPE_RUN_DIR": str(run_dir),
        CONFIG_VARIABLE: str(run_dir / RECIPE_FILE),
        "RLPIPE_LOG_FORMAT": "json",
        f"{prefix}_HTTP_HOST": "127.0.0.1",
        f"{prefix}_HTTP_PORT": str(port),
        # The feedback API's own port: free, so a busy 8080 never stops a local run.
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
        # The services share this machine's cores: one math thread each unless told otherwise,
        # so torch in the trainer and the workers does not oversubscribe them.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **trainer_bound(name, options),
        **worker_device(name, instance or name, options.worker_devices),
        **(bus_env or {}),
        **signing_environment(name, run_dir),
    }
    argv = list(options.commands.get(name) or [sys.executable, "-m", f"services.{pkg}"])
    return ChildSpec(instance or name, argv, env), f"http://127.0.0.1:{port}/healthz"


def trainer_bound(name: str, options: LaunchOptions) -> dict[str, str]:
    """The trainer stops itself at `max_trainer_steps` (exactly: the launcher only sees its
    step through health checks, a step or two late): an override, as the flag wins."""
    if name != "trainer" or options.max_trainer_steps is None:
        return {}
    overrides = json.loads(os.environ.get(OVERRIDES_VARIABLE) or "{}")
    overrides["trainer"] = {**overrides.get("trainer", {}), "max_steps": options.max_trainer_steps}
    return {OVERRIDES_VARIABLE: json.dumps(overrides)}


class LocalRun:
    """One launcher run: NATS, provisioning, services, watch, stop, summary."""

    def __init__(self, options: LaunchOptions, log: LauncherLog) -> None:
        self.options, self.log = options, log
        self.run_dir = (options.run_dir or default_run_dir()).resolve()
        self.nats: NatsServer | NatsCluster | None = None
        self.secure: SecureBus | None = None
        self.supervisor: Supervisor | None = None
        self.monitor: HealthMonitor | None = None
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.forced = False
        self._stop = asyncio.Event()
        self._started_at = time.monotonic()
        self.episode_figures: dict[str, Any] = {}

    async def run(self) -> int:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        write_recipe(run_recipe(self.options.recipe), self.run_dir)
        self._install_signal_handlers()
        try:
            if await self._start_nats() and await self._provision():
                await self._run_services()
        finally:
            await self._stop_everything()
            self._remove_signal_handlers()
        return self._finish()

    # --- stages -------------------------------------------------------------------------

    async def _start_nats(self) -> bool:
        log_path = self.run_dir / "logs" / "nats-server.log"
        try:
            self.nats = self._nats_server(log_path)
            await asyncio.to_thread(self.nats.start)
        except (OSError, RuntimeError, TimeoutError) as exc:
            return self._fail("nats_failed", f"NATS did not start: {exc} (log: {log_path})")
        self._write_pids()
        pids = [node.pid for node in self.nats.nodes]
        self.log.info("nats started", url=self.nats.url, pids=pids, run=str(self.run_dir))
        return not self._stop.is_set()

    def _nats_server(self, log_path: Path) -> NatsServer | NatsCluster:
        if self.options.secure_bus:
            self.secure = SecureBus.generate(self.run_dir, tls=self.options.tls)
        extra = self.secure.server_config() if self.secure else ""
        if self.options.nats_cluster == 1:
            return NatsServer(
                store_dir=self.run_dir / "nats",
                log_path=log_path,
                start_new_session=True,
                extra_config=extra,
            )
        return NatsCluster(
            root=self.run_dir / "nats",
            size=self.options.nats_cluster,
            log_dir=log_path.parent,
            start_new_session=True,
            extra_config=extra,
        )

    def _admin_options(self) -> NatsOptions | None:
        """The launcher's own connections (provisioning, the episode report): the admin."""
        return self.secure.admin_options() if self.secure else None

    async def _provision(self) -> bool:
        if self._stop.is_set() or not self.options.provision:
            return not self._stop.is_set()
        from libs.bus.provision import provision_bus  # imports nats-py: only when needed

        assert self.nats is not None
        try:
            replicas = nats_replicas(self.options)
            provisioning = provision_bus(self.nats.url, replicas, self._admin_options())
            report = await asyncio.wait_for(provisioning, timeout=60)
        except Exception as exc:  # any failure ends the run, with its reason in the summary
            reason = f"{type(exc).__name__}: {exc}"
            return self._fail("provision_failed", f"provisioning the bus failed: {reason}")
        self.log.info("bus provisioned", summary=report.summary())
        return not self._stop.is_set()

    def _setup_services(self, nats_url: str) -> tuple[Supervisor, HealthMonitor]:
        secure = self.secure
        pairs = [
            service_spec(
                service,
                self.options,
                nats_url,
                self.run_dir,
                instance,
                bus_env=secure.service_environment(service, nats_url) if secure else None,
            )
            for instance, service in self.options.instances()
        ]
        self.supervisor = Supervisor(
            [spec for spec, _ in pairs],
            self.run_dir / "logs",
            self.options.backoff,
            on_spawn=lambda _: self._write_pids(),
            on_event=self.log.info,
        )
        services = dict(self.options.instances())  # instance -> the service it runs
        self.monitor = HealthMonitor({spec.name: url for spec, url in pairs}, services=services)
        return self.supervisor, self.monitor

    async def _run_services(self) -> None:
        """Start the services, show them until a stop is asked for, then stop them."""
        assert self.nats is not None
        supervisor, monitor = self._setup_services(self.nats.url)
        try:
            await supervisor.start()
        except OSError as exc:
            self._fail("unhealthy", f"cannot start a service: {exc}")
            return
        health_task = asyncio.create_task(monitor.run(self._live_pids))
        nats_tasks = [asyncio.create_task(self._nats_watch(n).run()) for n in self.nats.nodes]
        bound = Bound(self.options.max_trainer_steps, self.options.duration_s)
        view = StatusView(self.log, supervisor, monitor, self.nats.url, self.run_dir, bound=bound)
        with view:
            try:
                await self._watch(view)
            finally:
                await self._with_view(view, self._await_late_services())
                # The worker first: its in-flight episodes finish while env-gateway answers.
                stopping = supervisor.stop(
                    self.options.stop_grace_s,
                    first=self.options.stopped_first(),
                    finishing=self._finishing(),
                )
                await self._with_view(view, stopping)
                health_task.cancel()
                for task in nats_tasks:  # before NATS itself is stopped
                    task.cancel()

    async def _await_late_services(self) -> None:
        """A run ending at its bound gives the services no check saw healthy yet the rest of
        `healthy_timeout_s` to answer: on a loaded machine a short run's bound can come before
        a slow service's first answer, and that service is starting, not broken (exit 3)."""
        assert self.monitor is not None
        await self.monitor.poll_once(self._live_pids())  # a bound can come between two polls
        while self.stop_reason in ("duration", "max_trainer_steps") and not self.forced:
            if not self._never_healthy() or self._stuck_service(self._run_time_s()):
                return
            await asyncio.sleep(TICK_S)

    def _nats_watch(self, server: NatsServer) -> NatsWatch:
        """Restarts NATS on its data folder if it dies; a run it cannot keep up fails (2)."""
        return NatsWatch(
            server,
            on_event=self.log.info,
            on_restart=self._write_pids,
            on_give_up=lambda why: self._fail("nats_failed", why),
        )

    async def _watch(self, view: StatusView) -> None:
        """Until a signal, a bound, or a service that will not become healthy."""
        started_at = time.monotonic()
        while not self._stop.is_set():
            view.refresh()
            self._check_bounds(time.monotonic() - started_at)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=TICK_S)
        self.log.info("stopping", reason=self.stop_reason)

    async def _with_view(self, view: StatusView, work: Awaitable[None]) -> None:
        """Await `work` while the view keeps showing progress (a stop takes seconds)."""
        task = asyncio.ensure_future(work)
        while not task.done():
            view.refresh()
            await asyncio.wait({task}, timeout=TICK_S)
        task.result()

    async def _stop_everything(self) -> None:
        if self.supervisor:
            await self.supervisor.stop(
                self.options.stop_grace_s,
                first=self.options.stopped_first(),
                finishing=self._finishing(),
            )
        await self._read_episode_figures()
        if self.nats:
            await asyncio.to_thread(self.nats.stop)

    async def _read_episode_figures(self) -> None:
        """First and last steps' episode figures, read from the bus while it still runs."""
        if self.nats is None or not self.nats.url or "trainer" not in self.options.services:
            return
        try:
            report = episode_report(self.run_dir, self.nats.url, self._admin_options())
            self.episode_figures = await asyncio.wait_for(report, timeout=60)
        except Exception as exc:  # a report is a nicety: the run's outcome does not depend on it
            self.log.error("episode figures unavailable", reason=f"{type(exc).__name__}: {exc}")

    # --- bounds and health ---------------------------------------------------------------

    def _check_bounds(self, elapsed_s: float) -> None:
        options = self.options
        if options.duration_s is not None and elapsed_s >= options.duration_s:
            self._request_stop("duration")
        step, max_steps = self._trainer_step(), options.max_trainer_steps
        if max_steps is not None and step is not None and step >= max_steps:
            self._request_stop("max_trainer_steps")
        if max_steps is not None and self._trainer_finished():
            self._request_stop("max_trainer_steps")
        stuck = self._stuck_service(elapsed_s)
        if stuck:
            self._fail("unhealthy", stuck)

    def _stuck_service(self, elapsed_s: float) -> str | None:
        """Why a service will not become healthy, or None: too long, or too many crashes."""
        assert self.supervisor is not None
        timed_out = elapsed_s >= self.options.healthy_timeout_s
        for name in self._never_healthy():
            child = self.supervisor.children[name]
            if timed_out or child.restarts >= self.options.max_restarts_unhealthy:
                return (
                    f"{name} never became healthy ({child.restarts} restarts in "
                    f"{elapsed_s:.0f} s, last: {child.detail or child.state}); its last output: "
                    f"{child.last_output()!r}; see {child.log_path}"
                )
        return None

    def _never_healthy(self) -> list[str]:
        """Services no health check saw healthy, but for a trainer that finished (exit 0 at
        its step bound): a short run's trainer can do its steps between two polls (a 3-step
        run under the test suite's load was called "never healthy" and failed)."""
        if self.monitor is None:
            return [name for name, _ in self.options.instances()]
        finished = {"trainer"} if self._trainer_finished() else set()
        return [
            name
            for name, record in self.monitor.records.items()
            if not record.ever_healthy and name not in finished
        ]

    def _trainer_step(self) -> int | None:
        record = self.monitor.records.get("trainer") if self.monitor else None
        step = record.body.get("step") if record else None
        return step if isinstance(step, int) else None

    def _trainer_finished(self) -> bool:
        """The trainer exited 0: it reached its step bound (before a health check saw it)."""
        child = self.supervisor.children.get("trainer") if self.supervisor else None
        return child is not None and child.last_exit_code == 0

    def _live_pids(self) -> dict[str, int | None]:
        assert self.supervisor is not None
        return {name: c.pid if c.alive else None for name, c in self.supervisor.children.items()}

    # --- stopping ------------------------------------------------------------------------

    def _finishing(self) -> tuple[str, ...]:
        """Services ending on their own: the trainer, when the run stops at its step bound
        (it stops itself there, writing its last checkpoint)."""
        return ("trainer",) if self.stop_reason == "max_trainer_steps" else ()

    def _request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def _fail(self, reason: str, error: str) -> bool:
        if self.error is None:
            self.error = error
            self.log.error(error)
        self._request_stop(reason)
        return False

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._stop.is_set():
            self.log.info(f"{sig.name}: stopping cleanly (Ctrl-C again to kill everything)")
            self._request_stop("signal")
            return
        self.log.error(f"{sig.name} again: killing everything")
        self.forced = True
        if self.supervisor:
            self.supervisor.kill_all()
        for node in self.nats.nodes if self.nats else []:
            if node.process:
                node.process.kill()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    # --- results -------------------------------------------------------------------------

    def _exit_code(self) -> int:
        if self.forced:
            return EXIT_FORCED
        codes = {
            "nats_failed": EXIT_NATS_FAILED,
            "provision_failed": EXIT_PROVISION_FAILED,
            "unhealthy": EXIT_UNHEALTHY,
        }
        if self.stop_reason in codes:
            return codes[self.stop_reason]
        if self.stop_reason != "signal" and self._never_healthy():
            self.error = f"never healthy during the run: {', '.join(self._never_healthy())}"
            return EXIT_UNHEALTHY
        return EXIT_OK

    def _finish(self) -> int:
        exit_code = self._exit_code()
        summary = build_summary(
            self.run_dir,
            [name for name, _ in self.options.instances()],
            self.supervisor,
            self.monitor,
            exit_code=exit_code,
            stop_reason=self.stop_reason,
            duration_s=round(self._run_time_s(), 1),
            nats_url=self.nats.url if self.nats else None,
        )
        summary.update(self.episode_figures)
        summary["trainer_step"] = final_trainer_step(self.run_dir, summary["trainer_step"])
        if self.error:
            summary["error"] = self.error
        (self.run_dir / "summary.json").write_text(json.dumps(summary) + "\n")
        print_summary(summary, self.run_dir)
        return exit_code

    def _run_time_s(self) -> float:
        return time.monotonic() - self._started_at

    def _write_pids(self) -> None:
        pids: dict[str, Any] = {
            "launcher": os.getpid(),
            "nats": [n.pid for n in self.nats.nodes if n.pid] if self.nats else [],
            # A cluster's nodes by name (what JetStream reports as a stream's leader).
            "nats_nodes": {n.server_name: n.pid for n in self.nats.nodes if n.server_name}
            if self.nats
            else {},
            "services": self.supervisor.all_pids() if self.supervisor else {},
        }
        path = self.run_dir / "pids.json"
        path.with_suffix(".tmp").write_text(json.dumps(pids))
        path.with_suffix(".tmp").replace(path)
