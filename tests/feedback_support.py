"""Helpers for the feedback tests: a running feedback-ingester (in this process, its API on
a free port) and readers of what it left on the bus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.feedback.auth import ApiKeyEntry, hash_key
from libs.feedback.join import JoinRunner
from proto import subjects
from proto.messages import FeedbackEvent, Message, SamplingSettings, ServedGeneration
from services.feedback_ingester.service import FeedbackIngesterService
from services.feedback_ingester.settings import FeedbackIngesterSettings

ACME_KEY = "rlfb_acme-test-key-0123456789"
GLOBEX_KEY = "rlfb_globex-test-key-0123456789"
ACME = ApiKeyEntry(name="acme-web", sha256=hash_key(ACME_KEY), products=["acme"])
GLOBEX = ApiKeyEntry(name="globex", sha256=hash_key(GLOBEX_KEY), products=["globex", "acme"])

M = TypeVar("M", bound=Message)


def auth(key: str = ACME_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def event_json(event_id: str, generation_id: str = "gen-1", **fields: Any) -> dict[str, Any]:
    """A valid feedback event as the product posts it."""
    return {
        "event_id": event_id,
        "generation_id": generation_id,
        "product": "acme",
        "signal": "accepted",
        "occurred_at": time.time(),
        "user_hash": "u-5f2c",
        "session_hash": "s-91aa",
        "experiment_arm": "control",
        **fields,
    }


def generation(generation_id: str, eligible: bool = True) -> ServedGeneration:
    return ServedGeneration(
        generation_id=generation_id,
        policy_version=3,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.25, -1.5],
        sampling=SamplingSettings(temperature=0.7),
        training_eligible=eligible,
        created_at=time.time(),
    )


@dataclass
class Ingester:
    service: FeedbackIngesterService
    client: httpx.AsyncClient
    task: asyncio.Task[None]

    @property
    def join(self) -> JoinRunner:
        assert self.service.join is not None, "the join runs (role all or join)"
        return self.service.join


def settings(**overrides: Any) -> FeedbackIngesterSettings:
    values: dict[str, Any] = {
        "api_host": "127.0.0.1",
        "api_port": 0,
        "http_port": 0,
        "api_keys": [ACME, GLOBEX],
        "join_window_s": 30.0,
        "join_sweep_interval_s": 0.2,
        "join_fetch_timeout_s": 0.2,
        "drain_timeout_s": 5.0,
        **overrides,
    }
    return FeedbackIngesterSettings(**values)


@asynccontextmanager
async def running_ingester(bus: Bus, **overrides: Any) -> AsyncIterator[Ingester]:
    """The service started on `bus` (provisioned), with an HTTP client on its API."""
    await provision(bus.js)
    service = FeedbackIngesterService(settings(**overrides))
    await service.start(bus)
    task = asyncio.create_task(service.run())
    base_url = f"http://127.0.0.1:{service.api.port}" if service.api else "http://unused"
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            yield Ingester(service, client, task)
    finally:
        await service.stop()
        await asyncio.wait_for(task, timeout=15)


async def stream_messages(js: JetStreamContext, stream: str, message_type: type[M]) -> list[M]:
    """Every message of `stream`, decoded, in order."""
    info = await js.stream_info(stream)
    found: list[M] = []
    if info.state.messages == 0:
        return found  # an empty stream's first_seq may be 0, which get_msg refuses
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await js.get_msg(stream, seq=seq)
        except NotFoundError:
            continue
        found.append(wire.decode(message_type, raw.data or b"", raw.headers))
    return found


async def publish_generation(bus: Bus, served: ServedGeneration) -> None:
    payload = wire.encode(served)
    headers = wire.headers_for(served, served.generation_id)
    await bus.js.publish(subjects.SERVING_GENERATIONS, payload, headers=headers)


def stored_event(raw_event: dict[str, Any]) -> FeedbackEvent:
    return msgspec.convert(raw_event, FeedbackEvent)
