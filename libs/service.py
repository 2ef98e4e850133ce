"""The lifecycle every service shares: start, run, stop; and the main that drives it.

`run_service` configures logging, logs the resolved settings, connects the bus, provisions
it (unless `provision` is off: a service whose NATS user may not touch the JetStream API),
serves /healthz, /readyz and /metrics, runs the service until SIGTERM/SIGINT or until its `run`
returns, then stops it (draining in-flight work) and closes the bus. A `run` that raises
takes the process down with a non-zero exit, loudly, never silently.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from abc import ABC, abstractmethod
from typing import Any

import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Gauge, Info

from libs.bus.connection import Bus, BusConnectError, connect_bus, redact_url
from libs.bus.provision import ProvisionError, ProvisionReport, provision
from libs.health_server import HEALTHY_STATUSES, HealthServer
from libs.logs import configure_logging
from libs.settings import ServiceSettings

log = structlog.get_logger(__name__)

SERVICE_UP = Gauge("rlpipe_service_up", "1 while the service runs", ["service"])
SERVICE_STARTED = Gauge(
    "rlpipe_service_start_time_seconds", "Unix time the service started", ["service"]
)
SERVICE_INFO = Info("rlpipe_service", "Which service this process runs")


class Service(ABC):
    """A service: `start` acquires what it needs, `run` works until stopped, `stop` drains."""

    name: str = "service"

    def __init__(self) -> None:
        self.bus: Bus | None = None
        self.status = "starting"
        self.detail = ""

    async def start(self, bus: Bus) -> None:
        """Set up consumers, models, files. The bus is connected and, unless the settings
        turn it off, provisioned."""
        self.bus = bus

    @abstractmethod
    async def run(self) -> None:
        """Do the service's work until `stop` is called (or until the work is done)."""

    async def stop(self) -> None:
        """Stop taking work, finish or hand back in-flight work, flush."""
        self.status = "stopping"

    def health(self) -> dict[str, Any]:
        """What /healthz returns: at least `service`, `status` and `detail`."""
        return {"service": self.name, "status": self.status, "detail": self.detail}

    def ready(self) -> bool:
        """What /readyz says (a load balancer's probe): healthy, unless the service says
        otherwise (a serve replica lent to RL is healthy but takes no product traffic)."""
        return self.health().get("status") in HEALTHY_STATUSES


async def serve(service: Service, settings: ServiceSettings) -> None:
    """Run `service` against the bus at `settings.nats_url` until a signal or its end."""
    SERVICE_INFO.info({"service": service.name})
    SERVICE_STARTED.labels(service.name).set(time.time())
    health = HealthServer(
        service.health, settings.http_host, settings.http_port, ready=service.ready
    )
    await health.start()
    bus = await connect_bus(
        settings.nats_url,
        name=service.name,
        max_attempts=settings.connect_attempts,
        options=settings.nats_options(),
    )
    try:
        if settings.provision:
            report = await _provision(bus, settings)
            log.info("bus ready", server=bus.server_version, provisioned=report.summary())
        else:
            log.info("bus ready", server=bus.server_version, provisioned="skipped (provision off)")
        await service.start(bus)
        SERVICE_UP.labels(service.name).set(1)
        await _run_until_signal(service, settings.drain_timeout_s)
    finally:
        SERVICE_UP.labels(service.name).set(0)
        await bus.close()
        await health.stop()
        log.info("service stopped")


async def _provision(bus: Bus, settings: ServiceSettings) -> ProvisionReport:
    """Provision, turning the timeout a user without JetStream API rights gets (the server
    refuses the request and nothing answers) into an error that names the switch."""
    try:
        return await provision(bus.js, replicas=settings.nats_replicas)
    except NatsTimeoutError as exc:
        variable = f"{settings.model_config.get('env_prefix', 'RLPIPE_')}PROVISION"
        raise ProvisionError(
            f"provisioning the bus at {redact_url(settings.nats_url)} timed out: the JetStream "
            "API did not answer. If this service's NATS user may not provision "
            f"(deploy/nats/SECURITY.md), set {variable}=false and let a service with the full "
            "user, or `rlpipe provision`, do it; else check that the server runs JetStream"
        ) from exc


async def _run_until_signal(service: Service, drain_timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    running = asyncio.create_task(service.run(), name=f"{service.name}.run")
    waiting = asyncio.create_task(stop_requested.wait())
    done, _ = await asyncio.wait({running, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if running in done:
        waiting.cancel()
        running.result()  # re-raise a crash of the service's loop
        log.info("service finished its work")
        await service.stop()
        return
    log.info("stop requested; draining", drain_timeout_s=drain_timeout_s)
    await service.stop()
    try:
        await asyncio.wait_for(running, timeout=drain_timeout_s)
    except TimeoutError:
        log.warning("drain timed out; cancelling", drain_timeout_s=drain_timeout_s)


def run_service(service: Service, settings: ServiceSettings) -> None:
    """The body of every service's `__main__`: exits 2 with one clear line when the bus is
    unreachable or holds definitions it cannot update; any other crash raises loudly."""
    configure_logging(service.name, settings.log_level, settings.log_format)
    log.info("starting", settings=settings.redacted())
    try:
        asyncio.run(serve(service, settings))
    except (BusConnectError, ProvisionError) as exc:
        log.error("cannot start", error=str(exc))
        sys.exit(2)
