"""The versioned rollout contract (proto.rollout_contract) over real HTTP and a real bus.

- What a requirement admits, and what the remote engine refuses from a fleet (pure).
- A serve replica following real signed versions (weight-broadcaster, nats-server) refuses
  a request for another exact version with the retryable 409 (Retry-After, the version it
  holds by number and hash), serves the one it holds, and names it on every choice.
- A request for an exact version whose weights changed between two holds is refused after
  generating, and nothing of it is recorded.
- A rollout-worker with the `remote` engine trains the demo (arith) through a serve replica:
  the trainer reaches its step bound on rollouts whose turns carry the versions the replica
  stated, each named by the hash the trainer signed.

Run: .venv/bin/python -m pytest tests/test_rollout_contract.py -q
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client import REGISTRY

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.chat.template import chat_template_for
from libs.engine.base import Completion, SamplingParams
from libs.engine.factory import EngineConfig
from libs.engine.hf import HFEngine
from libs.engine.remote import (
    ContractViolation,
    RemoteEngine,
    RemoteUnavailable,
    parse_choice,
    plan_calls,
)
from libs.envs.feeder import FeederConfig
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.version_book import VersionBook
from libs.serve.app import OpenAIApi, ServeConfig, create_app
from libs.serve.contract import statement
from libs.serve.generation import ServedPolicy
from libs.serve.records import GenerationRecorder
from libs.serve.server import ServeServer
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.metrics import read_steps
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from libs.weights.same_host import SameHostShareConfig, SameHostTakeConfig
from proto import streams
from proto.messages import ScoredRollout, ServedGeneration, WeightAnnouncement
from proto.rollout_contract import (
    VERSION_UNAVAILABLE,
    PolicyRequirement,
    PolicyVersionRef,
    parse_requirement,
)
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import state_trainer_policy, wait_for
from tests.marks import E2E

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


def test_a_grpo_group_is_one_request_per_prompt_split_at_the_fleets_bound() -> None:
    other = [1, 2]
    calls = plan_calls([PROMPT, other, PROMPT], num_samples=3, max_choices=4)
    assert [(call.prompt, len(call.slots)) for call in calls] == [
        (PROMPT, 4),
        (PROMPT, 2),
        (other, 3),
    ]
    slots = sorted(slot for call in calls for slot in call.slots)
    assert slots == [(p, s) for p in range(3) for s in range(3)]


def choice(start: int, end: int | None = None, **extra: Any) -> dict[str, Any]:
    stated = {
        "start": {"version": start, "hash": f"h{start}"},
        "end": {"version": start if end is None else end, "hash": f"h{end or start}"},
        "logprobs_mode": "processed_logprobs",
    }
    return {
        "index": 0,
        "token_ids": [1, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.0]},
        "finish_reason": "stop",
        "rl_policy": stated,
    } | extra


def test_a_choice_becomes_a_completion_with_the_versions_it_states() -> None:
    params = SamplingParams(temperature=0.7)
    completion = parse_choice(choice(4, 5), (2, 1), params, PolicyRequirement(), lambda v: "")
    assert (completion.prompt_index, completion.sample_index) == (2, 1)
    assert completion.token_ids == [1, 2] and completion.logprobs == [-0.5, -1.0]
    assert (completion.policy_version, completion.policy_version_hash) == (4, "h4")
    assert (completion.policy_version_end, completion.policy_version_end_hash) == (5, "h5")
    # One kind of logprobs from the fleet: raw ones are unknown unless the two kinds agree.
    assert all(math.isnan(v) for v in completion.raw_logprobs)
    plain = parse_choice(choice(4), (0, 0), SamplingParams(), PolicyRequirement(), lambda v: "")
    assert plain.raw_logprobs == plain.logprobs and plain.policy_version_end is None


def test_a_choice_says_where_its_versions_changed_and_the_completion_keeps_it() -> None:
    """A replica that swapped weights between decode steps states the first token of each
    new version (its engine's version switches); the worker's completion carries them."""
    served = Completion(
        prompt_index=0,
        sample_index=0,
        token_ids=[1, 2, 3],
        logprobs=[-0.5, -1.0, -0.2],
        raw_logprobs=[-0.5, -1.0, -0.2],
        finish_reason="length",
        policy_version=4,
        policy_version_end=6,
        version_switches=((1, 5), (2, 6)),
    )
    book = VersionBook()
    for version in (4, 5, 6):
        book.record(version, f"h{version}")
    stated = msgspec.json.decode(  # as JSON carries it
        msgspec.json.encode(statement(served, book, "processed_logprobs", raw=False))
    )
    assert stated["switches"] == [[1, 5], [2, 6]]
    body = {
        "index": 0,
        "token_ids": [1, 2, 3],
        "logprobs": {"token_logprobs": [-0.5, -1.0, -0.2]},
        "finish_reason": "length",
        "rl_policy": stated,
    }
    params = SamplingParams(temperature=0.7)
    completion = parse_choice(body, (0, 0), params, PolicyRequirement(), lambda v: "")
    assert completion.version_switches == ((1, 5), (2, 6))
    assert (completion.policy_version, completion.policy_version_end) == (4, 6)
    for switches, problem in (
        ([[1, 5], [3, 6]], "not all in 0..2"),
        ([[1, 5], [2, 5]], "not increasing"),
        ([[1, 5]], "is not policy_version_end 6"),
    ):
        wrong = body | {"rl_policy": stated | {"switches": switches}}
        with pytest.raises(ContractViolation, match=problem):
            parse_choice(wrong, (0, 0), params, PolicyRequirement(), lambda v: "")


def test_the_worker_refuses_what_the_contract_does_not_allow() -> None:
    params = SamplingParams(temperature=0.7)
    at_least_5 = PolicyRequirement(min_version=5)

    def refused(body: dict[str, Any], requirement: PolicyRequirement, signed: str = "") -> str:
        with pytest.raises(ContractViolation) as error:
            parse_choice(body, (0, 0), params, requirement, lambda version: signed)
        return str(error.value)

    unstated = {k: v for k, v in choice(5).items() if k != "rl_policy"}
    assert "does not speak the rollout contract" in refused(unstated, at_least_5)
    assert "outside what was required" in refused(choice(4), at_least_5)
    assert "not the trainer's weights" in refused(choice(5), at_least_5, signed="other")
    raw = choice(5)
    raw["rl_policy"]["logprobs_mode"] = "raw_logprobs"
    assert "processed_logprobs" in refused(raw, at_least_5)
    short = choice(5, token_ids=[1])
    assert "2 logprobs for 1 token ids" in refused(short, at_least_5)


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


async def test_the_remote_engine_retries_a_refusal_until_a_replica_holds_the_version(
    following_replica: FollowingReplica,
) -> None:
    engine = RemoteEngine(
        EngineConfig(
            type="remote", remote_urls=[following_replica.url], remote_model=MODEL,
            remote_retry_s=0.05, remote_max_retry_s=0.2, remote_max_attempts=1000,
        )
    )  # fmt: skip
    try:
        engine.requirement = lambda: PolicyRequirement(min_version=2)
        refusals_before = refusals()
        call = engine.submit([PROMPT] * 3, SamplingParams(max_tokens=4), num_samples=2)
        await wait_for(lambda: refusals() >= refusals_before + 2, 60, "two refusals")
        assert not call.done()  # still retrying: the replica holds version 1
        await following_replica.stage(2)
        completions = await asyncio.wrap_future(call)
        held = await following_replica.held()
        # Three copies of one prompt, two samples each: one request of n = 6, in order.
        assert [(c.prompt_index, c.sample_index) for c in completions] == [
            (p, s) for p in range(3) for s in range(2)
        ]
        for completion in completions:
            assert (completion.policy_version, completion.policy_version_hash) == (
                held["version"],
                held["hash"],
            )
            assert len(completion.logprobs) == len(completion.token_ids) >= 1
        assert engine.policy_version == 2
        # Bounded: a version that never comes fails the call after its attempts.
        engine.requirement = lambda: PolicyRequirement(min_version=99)
        bounded = EngineConfig(
            type="remote", remote_urls=[following_replica.url], remote_model=MODEL,
            remote_retry_s=0.01, remote_max_retry_s=0.01, remote_max_attempts=3,
        )  # fmt: skip
        hopeless = RemoteEngine(bounded)
        hopeless.requirement = engine.requirement
        with pytest.raises(RemoteUnavailable, match=r"after 3 attempts.*holds"):
            await asyncio.wrap_future(hopeless.submit([PROMPT], SamplingParams(max_tokens=2)))
        hopeless.close()
    finally:
        engine.close()


def refusals() -> float:
    """Version refusals the remote engines have met (their metric)."""
    sample = REGISTRY.get_sample_value(
        "rlpipe_remote_engine_requests_total", {"outcome": "refused"}
    )
    return sample or 0.0


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


# --- a remote-engine worker trains the demo through a serve replica ---------------------------


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as services:
        yield services


@E2E
async def test_a_remote_engine_worker_trains_the_demo_through_a_serve_replica(
    bus: Bus, stack: AsyncExitStack, tmp_path: Path
) -> None:
    await provision(bus.js)
    run_dir = tmp_path / "run"
    port = free_port()
    replica = serve_replica(port)
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="remote-worker",
            policy=PolicyConfig(device="cpu"),  # its tokenizer; the fleet holds the weights
            engine=EngineConfig(
                type="remote", remote_urls=[f"http://127.0.0.1:{port}/v1"], remote_model=MODEL
            ),
            max_batch_tasks=2,
            fetch_timeout_s=0.2,
            drain_timeout_s=5.0,
        )
    )
    trainer = TrainerService(
        TrainerSettings(
            run_dir=run_dir,
            policy=PolicyConfig(device="cpu"),
            batch_groups=1,
            max_steps=STEPS,
            eval=EvalGateConfig(every_versions=0),
            checkpoint_every_steps=1000,
            same_host=SameHostShareConfig(enabled=False),
        )
    )
    for service in (
        EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="async"))),
        RewardService(RewardSettings(fetch_timeout_s=0.2)),
        WeightBroadcasterService(
            WeightBroadcasterSettings(run_dir=run_dir, encode=EncodeOptions(threads=1))
        ),
        replica,
        worker,
        trainer,
    ):
        await run_service(stack, service, bus)

    await wait_for(lambda: len(read_steps(run_dir)) >= STEPS, 300, f"{STEPS} trainer steps")

    steps = read_steps(run_dir)
    assert sum(step.num_samples for step in steps) > 0
    # The logprobs the replica returned are the trainer's at the same version (numerics only).
    same_version = [s.mismatch_by_staleness["0"] for s in steps if "0" in s.mismatch_by_staleness]
    assert all(figures.mean_abs < 1e-3 for figures in same_version if figures.tokens)
    # The worker generated nothing itself: it took no weights, its engine is the fleet.
    assert isinstance(worker.engine, RemoteEngine)
    assert worker.health()["weight_swaps"] == 0 and worker.health()["rollouts_published"] > 0
    # Every turn names the version the replica stated, by the hash the trainer signed.
    hashes = await announced_hashes(bus)
    scored = await stream_messages(bus, streams.ROLLOUTS_SCORED.name, ScoredRollout)
    turns = [t for s in scored for t in s.rollout.turns if t.role == "assistant"]
    assert turns and all(s.rollout.worker_id == "remote-worker" for s in scored)
    for turn in turns:
        assert turn.policy_version is not None
        assert turn.policy_version_hash == hashes[turn.policy_version]
    assert max(t.policy_version or 0 for t in turns) >= 1  # versions trained after the start
    # ...and each was generated by the replica (recorded there, never for feedback training).
    records = await stream_messages(bus, streams.SERVING_GENERATIONS.name, ServedGeneration)
    assert len(records) >= len(turns) and not any(r.training_eligible for r in records)
    served = {(tuple(r.completion_token_ids), r.policy_version) for r in records}
    assert all((tuple(t.token_ids), t.policy_version) in served for t in turns)
