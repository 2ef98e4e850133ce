"""The versioned rollout contract (proto.rollout_contract) over real HTTP and a real bus.

- What a requirement admits (pure).
- A serve replica following real signed versions (weight-broadcaster, nats-server) refuses
  a request for another exact version with the retryable 409 (Retry-After, the version it
  holds by number and hash), serves the one it holds, and names it on every choice.
- A request for an exact version whose weights changed between two holds is refused after
  generating, and nothing of it is recorded.

Run: .venv/bin/python -m pytest tests/test_rollout_contract.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.chat.template import chat_template_for
from libs.engine.base import SamplingParams
from libs.engine.hf import HFEngine
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.version_book import VersionBook
from libs.serve.app import OpenAIApi, ServeConfig, create_app
from libs.serve.generation import ServedPolicy
from libs.serve.records import GenerationRecorder
from libs.serve.server import ServeServer
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from libs.weights.same_host import SameHostTakeConfig
from proto import streams
from proto.messages import ServedGeneration, WeightAnnouncement
from proto.rollout_contract import (
    VERSION_UNAVAILABLE,
    PolicyRequirement,
    PolicyVersionRef,
    parse_requirement,
)
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import state_trainer_policy, wait_for

MODEL = "contract-test"
TOKENIZER = ByteTokenizer()
PROMPT = list(b"7+5=")
STEPS = 3


def ref(version: int, version_hash: str = "") -> PolicyVersionRef:
    return PolicyVersionRef(version=version, hash=version_hash)


# --- the contract itself ----------------------------------------------------------------------


def test_min_admits_that_version_and_newer_exact_only_that_one() -> None:
    at_least_3 = PolicyRequirement(min_version=3)
    assert not at_least_3.admits_start(ref(2))
    assert at_least_3.admits_start(ref(3)) and at_least_3.admits_start(ref(9))
    exactly_3 = PolicyRequirement(exact_version=3, exact_hash="aa")
    assert exactly_3.admits_start(ref(3, "aa"))
    assert not exactly_3.admits_start(ref(3, "bb"))  # the same number, other weights
    assert not exactly_3.admits_start(ref(4, "aa"))
    assert PolicyRequirement().admits_start(ref(0))


def test_a_malformed_requirement_is_refused_with_the_reason() -> None:
    for body, reason in [
        ({"min_version": 1, "exact_version": 2}, "not both"),
        ({"exact_hash": "aa"}, "needs exact_version"),
        ({"min_version": -1}, ">= 0"),
        ({"min_versoin": 1}, "unknown field"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_requirement(body)


# --- a serve replica following real versions --------------------------------------------------


async def run_service(stack: AsyncExitStack, service: Service, bus: Bus) -> None:
    """Start `service` and run it until the stack closes (then stop it, wait for it)."""
    await service.start(bus)
    task = asyncio.create_task(service.run(), name=service.name)

    async def shut_down() -> None:
        await service.stop()
        await asyncio.wait_for(task, timeout=30)

    stack.push_async_callback(shut_down)


def serve_replica(port: int, **fields: Any) -> RolloutWorkerService:
    """A serving-only replica that follows the trainer's versions through the chain."""
    return RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="serve-replica",
            policy=PolicyConfig(device="cpu", seed=9),  # not the trainer's: it takes its
            consume_tasks=False,
            serve=ServeConfig(port=port, model_name=MODEL),
            same_host=SameHostTakeConfig(enabled=False),
            drain_timeout_s=5.0,
            **fields,
        )
    )


async def announced_hashes(bus: Bus) -> dict[int, str]:
    """Version -> the hash its signed announcement names, for every announcement."""
    name = streams.WEIGHTS_ANNOUNCE.name
    info = await bus.js.stream_info(name)
    hashes = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(name, seq)
        announcement = wire.decode(WeightAnnouncement, raw.data or b"", dict(raw.headers or {}))
        hashes[announcement.version] = announcement.version_hash
    return hashes


async def stream_messages(bus: Bus, name: str, kind: type[Any]) -> list[Any]:
    info = await bus.js.stream_info(name)
    if info.state.messages == 0:
        return []
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(name, seq)
        out.append(wire.decode(kind, raw.data or b"", dict(raw.headers or {})))
    return out


@dataclass
class FollowingReplica:
    """A serve replica following the versions a weight-broadcaster announces."""

    bus: Bus
    replica: RolloutWorkerService
    url: str
    staging: Path

    async def stage(self, version: int) -> None:
        """Announce `version` (weights of seed 10 + version) and wait until it is served."""
        state = build_policy(PolicyConfig(seed=10 + version)).state_dict()
        await stage_weights(Publisher(self.bus.js), self.staging, state, version)
        await wait_for(lambda: self.replica.engine_version == version, 60, f"version {version}")

    async def held(self) -> dict[str, Any]:
        """The version it holds as the contract names it: number and signed hash."""
        version = self.replica.engine_version
        assert version is not None
        return {"version": version, "hash": (await announced_hashes(self.bus))[version]}


@pytest.fixture
async def following_replica(bus: Bus, tmp_path: Path) -> AsyncIterator[FollowingReplica]:
    """The replica, holding version 1 (it took 0 and then 1)."""
    await provision(bus.js)
    await state_trainer_policy(bus.js)
    port = free_port()
    replica = serve_replica(port)
    staging = tmp_path / "staging"
    broadcaster = WeightBroadcasterService(
        WeightBroadcasterSettings(staging_dir=staging, encode=EncodeOptions(threads=1))
    )
    async with AsyncExitStack() as stack:
        for service in (broadcaster, replica):
            await run_service(stack, service, bus)
        following = FollowingReplica(bus, replica, f"http://127.0.0.1:{port}/v1", staging)
        for version in (0, 1):
            await following.stage(version)
        yield following


async def test_an_exact_version_request_to_a_replica_on_another_version_gets_the_retryable_refusal(
    following_replica: FollowingReplica,
) -> None:
    held = await following_replica.held()
    hashes = await announced_hashes(following_replica.bus)
    async with httpx.AsyncClient(base_url=following_replica.url, timeout=60) as http:

        async def complete(rl_policy: dict[str, Any]) -> httpx.Response:
            body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "rl_policy": rl_policy}
            return await http.post("/completions", json=body)

        # Another exact version: refused before generating, retryable, naming what it holds.
        refused = await complete({"exact_version": 0})
        assert refused.status_code == 409, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == VERSION_UNAVAILABLE and error["param"] == "rl_policy"
        assert error["rl_policy"]["held"] == held == {"version": 1, "hash": hashes[1]}
        assert error["rl_policy"]["required"]["exact_version"] == 0
        # The same number under another hash is another version: refused too.
        other_hash = await complete({"exact_version": 1, "exact_hash": hashes[0]})
        assert other_hash.status_code == 409
        # A newer minimum than it holds: refused; one it meets: served.
        assert (await complete({"min_version": 2})).status_code == 409
        served = await complete({"exact_version": 1, "exact_hash": hashes[1]})
        assert served.status_code == 200, served.text
        for stated in (c["rl_policy"] for c in served.json()["choices"]):
            assert stated["start"] == stated["end"] == held
            assert stated["logprobs_mode"] == "processed_logprobs"
        # Without rl_policy, every choice still states its versions.
        plain = await http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert plain.json()["choices"][0]["rl_policy"]["start"] == held
    # Only the two served requests were recorded: 2 choices and 1.
    bus = following_replica.bus
    records = await stream_messages(bus, streams.SERVING_GENERATIONS.name, ServedGeneration)
    assert len(records) == 3 and {r.policy_version for r in records} == {1}


async def test_an_exact_version_broken_by_a_swap_between_holds_is_refused_and_not_recorded(
    bus: Bus,
) -> None:
    """hold_tokens=1: every token is its own engine call, and the weights change (a real
    swap of the real engine, under the batcher's gate) after the first one."""
    await provision(bus.js)
    engine = HFEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER)
    batcher = GenerationBatcher(engine, batch_window_s=0.001)
    batcher.open.set()
    book = VersionBook()
    book.record(0, "hash-of-0")
    holds = 0

    async def generate_then_swap(prompts: list[list[int]], params: SamplingParams) -> Any:
        nonlocal holds
        completions = await batcher.generate_served(prompts, params)
        holds += 1
        if holds == 1:
            async with batcher.gate:
                await asyncio.to_thread(engine.update_weights, {}, 1)
            book.record(1, "hash-of-1")
        return completions

    recorder = GenerationRecorder(Publisher(bus.js))
    served = ServedPolicy(generate_then_swap, TOKENIZER, recorder=recorder, hold_tokens=1)
    api = OpenAIApi(
        served,
        chat_template_for(TOKENIZER),
        lambda: engine.policy_version,
        ServeConfig(model_name=MODEL),
        versions=book,
    )
    server = ServeServer(create_app(api), "127.0.0.1", 0, graceful_s=2)
    await server.start()
    running = asyncio.create_task(batcher.run())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}/v1") as http:
            body = {"prompt": PROMPT, "max_tokens": 3, "seed": 1, "rl_policy": {"exact_version": 0}}
            response = await http.post("/completions", json=body, timeout=60)
            assert holds >= 2  # generated, on two versions
            assert response.status_code == 409, response.text
            error = response.json()["error"]
            assert error["code"] == VERSION_UNAVAILABLE
            assert error["rl_policy"]["held"] == {"version": 1, "hash": "hash-of-1"}
            assert "changed from version 0 to 1" in error["message"]
            # A minimum is kept by a newer version: served, stating both ends.
            body["rl_policy"] = {"min_version": 1}
            ok = await http.post("/completions", json=body, timeout=60)
            assert ok.status_code == 200, ok.text
        assert recorder.num_recorded == 1
        records = await stream_messages(bus, streams.SERVING_GENERATIONS.name, ServedGeneration)
        assert [r.policy_version for r in records] == [1]
    finally:
        await server.stop()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
