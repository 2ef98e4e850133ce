"""The feedback-ingester service object: the HTTP feedback API and the join, on one loop.

`role` picks what this process runs: `api` (FastAPI on uvicorn, publishing events to the
feedback stream, optionally through a feedback-only NATS user), `join` (feedback events
matched with served generations into online samples), or `all`. The logic is in
libs.feedback; this file wires it to the service lifecycle.

The API touches the bus only to publish feedback events, read their acks and keep its keys'
rate-limit buckets (the KV bucket feedback_rate); it needs no other JetStream API call or
subscription of the service connection. So `role=api` with
`provision` off runs with the feedback-only user alone (deploy/nats/SECURITY.md): set
`api_nats_url` to it (its connection reads acks under the inbox prefix that user may read)
and the service connection, which then only connects, may carry the same user.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from libs.api_server import ApiServer
from libs.background_tasks import BackgroundTasks
from libs.bus.connection import Bus, NatsOptions
from libs.bus.publisher import Publisher
from libs.feedback.api import ApiLimits, FeedbackIngest, create_app
from libs.feedback.auth import build_key_store
from libs.feedback.join import JoinConfig, Joiner, JoinRunner, bind_bucket, setup_join_state
from libs.feedback.kv_state import KvKeys
from libs.feedback.rate_limit import SharedTokenBucket
from libs.feedback.restricted_bus import connect_restricted_bus
from libs.service import Service
from proto import streams
from services.feedback_ingester.settings import FeedbackIngesterSettings

log = structlog.get_logger(__name__)


class FeedbackIngesterService(Service):
    """Takes product feedback over HTTP and joins it with served generations."""

    name = "feedback-ingester"

    def __init__(self, settings: FeedbackIngesterSettings) -> None:
        super().__init__()
        self.settings = settings
        self.api: ApiServer | None = None
        self.ingest: FeedbackIngest | None = None
        self.join: JoinRunner | None = None
        self._api_bus: Bus | None = None
        self._stopped = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        parts = []
        if self.settings.role in ("all", "join"):
            await self._start_join(bus)
            parts.append(f"joining within {self.settings.join_window_s:g} s")
        if self.settings.role in ("all", "api"):
            await self._start_api(bus)
            assert self.ingest is not None and self.api is not None
            keys = len(self.ingest.keys)
            parts.append(f"feedback API on port {self.api.port} with {keys} API keys")
            if not keys:
                parts.append("no API keys configured: every POST gets 401")
                log.warning("no API keys configured; set RLPIPE_FEEDBACK_INGESTER_API_KEYS(_FILE)")
        self.status = "ok"
        self.detail = "; ".join(parts)

    async def _start_api(self, bus: Bus) -> None:
        settings = self.settings
        keys = build_key_store(settings.api_keys, settings.api_keys_file)
        if settings.api_nats_url:
            options = settings.nats_options()
            tls = NatsOptions(
                tls_ca_file=options.tls_ca_file,
                tls_cert_file=options.tls_cert_file,
                tls_key_file=options.tls_key_file,
            )
            self._api_bus = await connect_restricted_bus(
                settings.api_nats_url, f"{self.name}-api", settings.api_nats_inbox_prefix, tls=tls
            )
        js = (self._api_bus or bus).js
        rate = streams.FEEDBACK_RATE
        limiter = SharedTokenBucket(
            KvKeys(js, await bind_bucket(js, rate.bucket), rate),
            "rate",
            rate_per_s=settings.rate_per_s,
            burst=settings.rate_burst_events,
            lease=settings.rate_lease_events,
        )
        publisher = Publisher(
            js,
            max_in_flight=settings.publish_max_in_flight,
            ack_timeout_s=settings.publish_timeout_s,
            max_attempts=settings.publish_attempts,
            retry_window_s=0.0,  # bounded: the product's request waits (a 503 after)
        )
        self.ingest = FeedbackIngest(
            keys,
            limiter,
            publisher,
            ApiLimits(
                max_body_bytes=settings.max_body_bytes,
                max_batch_events=settings.max_batch_events,
            ),
        )
        app = create_app(self.ingest, self.health)
        self.api = ApiServer(
            app,
            settings.resolved_api_host,
            settings.api_port,
            graceful_s=settings.drain_timeout_s,
            task_name="api",
            label="feedback API",
            port_setting="RLPIPE_FEEDBACK_INGESTER_API_PORT",
        )
        await self.api.start()

    async def _start_join(self, bus: Bus) -> None:
        settings = self.settings
        kv = await setup_join_state(bus.js)
        publisher = Publisher(bus.js)
        config = JoinConfig(
            window_s=settings.join_window_s,
            sweep_interval_s=settings.join_sweep_interval_s,
            generation_sample_cap=settings.join_generation_sample_cap,
            key_sample_cap=settings.join_key_sample_cap,
            key_sample_window_s=settings.join_key_sample_window_s,
        )
        self.join = JoinRunner(
            Joiner(bus.js, kv, publisher, config),
            bus.js,
            publisher,
            batch_size=settings.join_batch_size,
            concurrency=settings.join_concurrency,
            fetch_timeout_s=settings.join_fetch_timeout_s,
        )

    async def run(self) -> None:
        """Until stopped; if the API server or the join dies on its own, raise."""
        async with BackgroundTasks(stop=self._stopped) as parts:
            if self.api is not None and self.api.task is not None:
                parts.adopt(self.api.task)
            if self.join is not None:
                parts.start("join", self.join.run())
            await parts.until()
            await parts.join()  # `stop` drains them: in-flight requests are answered first

    async def stop(self) -> None:
        await super().stop()
        self._stopped.set()
        if self.api is not None:
            await self.api.stop()  # answers in-flight requests (their acks come) first
        if self.join is not None:
            await self.join.stop(self.settings.drain_timeout_s)
        if self._api_bus is not None:
            with contextlib.suppress(Exception):
                await self._api_bus.close()

    def health(self) -> dict[str, Any]:
        report = super().health()
        if self.join is not None:
            report["joined"] = self.join.joiner.num_joined
            report["join_dead_letters"] = self.join.joiner.num_dead
            report["join_capped"] = self.join.joiner.num_capped
        return report
