"""Online RL from product feedback: the pure math by hand, then the trainer on a real bus
(an accepted completion's logprob goes up, a rejected one's down, each sample trained once
across a resume) and the eval gate recording promotions and rejections with their scores."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch
from prometheus_client import REGISTRY

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.domains.registry import make_env
from libs.engine.base import SamplingParams
from libs.engine.hf import HFEngine
from libs.envs.client import EnvClient
from libs.envs.server import EnvServer, ServerLimits
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.rl import NO_VERSION
from libs.rl.online import (
    DEFAULT_SIGNAL_REWARDS,
    OnlineBaselines,
    build_online_batch,
    check_signal_rewards,
    context_kind,
    online_advantages,
    online_sample_problem,
    signal_reward,
    split_online_by_staleness,
)
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.weights_follower import WeightsFollower
from libs.tokenizer import ByteTokenizer
from libs.trainer.checkpoint import latest_checkpoint
from libs.trainer.config import TrainerConfig
from libs.trainer.eval_gate import EvalGate, EvalGateConfig, held_out_tasks
from libs.trainer.loop import Trainer
from libs.trainer.metrics import read_step_samples
from libs.trainer.mix import Stream, choose_stream, scheduled_stream
from libs.trainer.online_step import OnlineConfig
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from libs.weights.receiver import WeightReceiver
from proto import streams, subjects
from proto.messages import (
    DeadLetter,
    FeedbackEvent,
    OnlineSample,
    PromotionDecision,
    SamplingSettings,
    ServedGeneration,
)
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.signing_support import trusting

TOKENIZER = ByteTokenizer()
POLICY = PolicyConfig(preset="tiny", seed=0)


@pytest.fixture
async def arith_gateway(bus: Bus) -> AsyncIterator[EnvClient]:
    """env-gateway serving arith on the test bus: the gate's held-out episodes run there."""
    server = EnvServer(bus.nc, {"arith": make_env("arith")}, ServerLimits(step_timeout_s=30))
    await server.start()
    yield EnvClient(bus.nc)
    await server.stop()


def sample(
    sample_id: str,
    signal: str = "accepted",
    *,
    prompt: list[int] | None = None,
    completion: list[int] | None = None,
    logprobs: list[float] | None = None,
    version: int = 0,
    product: str = "acme",
    kind: str | None = "chat",
) -> OnlineSample:
    completion = [20, 21] if completion is None else completion
    generation = ServedGeneration(
        generation_id=f"gen-{sample_id}",
        policy_version=version,
        prompt_token_ids=[10, 11] if prompt is None else prompt,
        completion_token_ids=completion,
        logprobs=[-1.0] * len(completion) if logprobs is None else logprobs,
        sampling=SamplingSettings(),
        metadata={} if kind is None else {"context_kind": kind},
    )
    feedback = FeedbackEvent(
        event_id=sample_id,
        generation_id=generation.generation_id,
        product=product,
        signal=signal,  # type: ignore[arg-type]
        occurred_at=1.0,
    )
    return OnlineSample(sample_id=sample_id, generation=generation, feedback=feedback)


# ---- pure ----------------------------------------------------------------------------------


def test_signals_map_to_configured_rewards_and_an_incomplete_mapping_is_refused() -> None:
    assert signal_reward("accepted", DEFAULT_SIGNAL_REWARDS) == 0.75
    assert signal_reward("rejected", DEFAULT_SIGNAL_REWARDS) == -0.25
    assert signal_reward("ignored", DEFAULT_SIGNAL_REWARDS) == 0.0
    with pytest.raises(ValueError, match="'edited' has no reward"):
        signal_reward("edited", {"accepted": 1.0})
    with pytest.raises(ValueError, match=r"missing \['rejected'.*unknown \['acepted'\]"):
        check_signal_rewards({"accepted": 1.0, "acepted": 1.0})
    assert check_signal_rewards(DEFAULT_SIGNAL_REWARDS) == DEFAULT_SIGNAL_REWARDS


def test_advantage_is_reward_minus_a_per_kind_baseline_updated_only_after_use() -> None:
    rewards = {**DEFAULT_SIGNAL_REWARDS, "accepted": 1.0, "rejected": 0.0}
    samples = [
        sample("a", "accepted"),
        sample("b", "rejected"),
        sample("c", "thumbs_up", kind="code"),  # another kind: its own baseline
        sample("d", "accepted"),
        sample("e", "accepted", product="globex"),  # same kind name, another product
    ]
    baselines = OnlineBaselines()
    result = online_advantages(samples, rewards, baselines, decay=0.5)
    # acme:chat baseline: 0 -> 1.0 (first reward, running mean) -> 0.5 (EMA weight 0.5).
    assert result.kinds == ["acme:chat", "acme:chat", "acme:code", "acme:chat", "globex:chat"]
    assert result.baselines == [0.0, 1.0, 0.0, 0.5, 0.0]
    assert result.advantages.tolist() == [1.0, -1.0, 0.5, 0.5, 1.0]
    assert baselines.value("acme:chat") == pytest.approx(0.75)  # 0.5 + 0.5 * (1 - 0.5)
    assert baselines.counts == {"acme:chat": 3, "acme:code": 1, "globex:chat": 1}
    restored = msgspec.json.decode(msgspec.json.encode(baselines), type=OnlineBaselines)
    assert restored == baselines
    assert context_kind(sample("f", kind=None)) == "acme:"


def test_online_batch_trains_completion_tokens_with_served_logprobs_and_versions() -> None:
    batch = build_online_batch(
        [
            sample("a", completion=[20, 21, 22], logprobs=[-0.1, -0.2, -0.3], version=5),
            sample("b", prompt=[10], completion=[30], logprobs=[-0.5], version=3),
        ],
        [0.5, -0.25],
        pad_id=TOKENIZER.pad_id,
    )
    pad = TOKENIZER.pad_id
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 22], [10, 30, pad, pad, pad]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # Entry t is about token t+1: the prompt's second token is not trained, the rest are.
    assert batch.loss_mask.tolist() == [[False, True, True, True], [True, False, False, False]]
    expected = torch.tensor([[0.0, -0.1, -0.2, -0.3], [-0.5, 0.0, 0.0, 0.0]])
    assert torch.equal(batch.behavior_logprobs, expected)
    n = NO_VERSION
    assert batch.token_versions.tolist() == [[n, 5, 5, 5], [3, n, n, n]]
    assert batch.advantages.tolist() == [0.5, -0.25] and batch.sample_ids == ["a", "b"]
    truncated = build_online_batch([sample("a")], [1.0], pad_id=pad, max_length=3)
    assert truncated.input_ids.tolist() == [[10, 11, 20]] and truncated.num_truncated == 1
    # Served across a weight swap between decode steps: each token under the version that
    # sampled it (the paged engine's switches, carried on the served generation).
    swapped = sample("c", completion=[20, 21, 22], logprobs=[-0.1] * 3, version=5)
    swapped.generation.policy_version_end = 7
    swapped.generation.version_switches = ((1, 6), (2, 7))
    batch = build_online_batch([swapped], [1.0], pad_id=pad)
    assert batch.token_versions.tolist() == [[n, 5, 6, 7]]


def test_untrainable_samples_are_named_and_refused() -> None:
    assert online_sample_problem(sample("ok")) is None
    bad = sample("short", completion=[20, 21], logprobs=[-1.0])
    assert "2 completion tokens but 1 logprobs" in (online_sample_problem(bad) or "")
    assert online_sample_problem(sample("empty", completion=[])) == "empty completion"
    with pytest.raises(ValueError, match="online sample 'short'"):
        build_online_batch([bad], [1.0], pad_id=0)


def test_samples_outside_the_online_staleness_bound_are_dropped_and_counted() -> None:
    samples = [sample(str(v), version=v) for v in (10, 8, 7, 11)]
    split = split_online_by_staleness(samples, trainer_version=10, max_staleness=2)
    assert [s.sample_id for s in split.kept] == ["10", "8"]
    assert [s.sample_id for s in split.dropped] == ["7", "11"]
    assert split.staleness == [0, 2, 3, -1] and split.histogram == {-1: 1, 0: 1, 2: 1, 3: 1}


def test_step_schedule_spreads_online_steps_and_never_waits_on_an_empty_stream() -> None:
    assert [s for s in range(12) if scheduled_stream(s, 0.25) == "online"] == [3, 7, 11]
    assert all(scheduled_stream(s, 0.0) == "offline" for s in range(10))
    assert all(scheduled_stream(s, 1.0) == "online" for s in range(10))

    def choose(scheduled: Stream, offline_ready: bool, fresh: int, waited_s: float) -> object:
        return choose_stream(
            scheduled,
            offline_ready=offline_ready,
            online_fresh=fresh,
            online_batch_samples=4,
            online_fraction=0.5,
            waited_s=waited_s,
            stream_wait_s=5.0,
        )

    # The scheduled stream first; a partial online batch only after the wait.
    assert choose("online", True, 4, 0) == "online"
    assert choose("online", True, 2, 0) is None
    assert choose("online", False, 2, 5) == "online"
    # The scheduled stream is empty past the wait: the other one, whatever it has.
    assert choose("online", True, 0, 5) == "offline"
    assert choose("offline", False, 1, 5) == "online"
    assert choose("offline", False, 1, 1) is None


def test_held_out_tasks_are_fixed_and_never_named_like_training_tasks() -> None:
    config = EvalGateConfig(num_tasks=5, difficulty=2)
    tasks = held_out_tasks(config)
    assert [t.task_id for t in tasks] == [f"arith-d2-s1000003-{i}" for i in range(5)]
    assert [t.prompt for t in held_out_tasks(config)] == [t.prompt for t in tasks]


# ---- the trainer on a real bus -------------------------------------------------------------


def served_sample(sample_id: str, signal: str, prompt_text: str, seed: int) -> OnlineSample:
    """A completion sampled by the tiny policy at version 0, with its real logprobs."""
    engine = HFEngine(build_policy(POLICY), TOKENIZER)
    prompt = TOKENIZER.encode(prompt_text)
    (completion,) = engine.generate([prompt], SamplingParams(max_tokens=4, seed=seed))
    return sample(
        sample_id,
        signal,
        prompt=prompt,
        completion=completion.token_ids,
        logprobs=completion.logprobs,
        version=0,
    )


def completion_logprob(model: torch.nn.Module, online: OnlineSample) -> float:
    generation = online.generation
    ids = torch.tensor([[*generation.prompt_token_ids, *generation.completion_token_ids]])
    with torch.no_grad():
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids))  # type: ignore[arg-type]
    return float(logprobs[0, len(generation.prompt_token_ids) - 1 :].sum())


def online_trainer_config(**overrides: object) -> TrainerConfig:
    fields: dict[str, object] = {
        "policy": POLICY,
        "online": OnlineConfig(fraction=1.0, stream_wait_s=0.0, batch_samples=1),
        "eval": EvalGateConfig(every_versions=0),
        "max_steps": 1,
    }
    fields.update(overrides)
    return TrainerConfig(**fields)  # type: ignore[arg-type]


async def publish_online(bus: Bus, online: OnlineSample) -> None:
    await Publisher(bus.js).publish(subjects.ROLLOUTS_ONLINE, online, msg_id=online.sample_id)


async def decisions(bus: Bus) -> list[PromotionDecision]:
    info = await bus.js.stream_info(streams.PROMOTIONS.name)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(streams.PROMOTIONS.name, seq)
        found.append(wire.decode(PromotionDecision, raw.data or b"", raw.headers))
    return found


def read_steps(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "trainer" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_samples(run_dir: Path) -> list[dict[str, object]]:
    """Each step's sample ids (trainer/step_samples.jsonl), as the trainer's reader reads them."""
    return [msgspec.to_builtins(record) for record in read_step_samples(run_dir)]


async def test_online_steps_move_the_policy_toward_accepted_and_away_from_rejected(
    bus: Bus, tmp_path: Path, arith_gateway: EnvClient
) -> None:
    await provision(bus.js)
    accepted = served_sample("fb-accepted", "accepted", "3=", seed=1)
    rejected = served_sample("fb-rejected", "rejected", "5=", seed=2)
    gate = EvalGateConfig(every_versions=1, num_tasks=4, margin=1.0)
    first = Trainer(online_trainer_config(eval=gate), tmp_path, bus, Publisher(bus.js))
    await first.setup()
    before = completion_logprob(first.model, accepted)
    await publish_online(bus, accepted)
    await first.run()
    assert completion_logprob(first.model, accepted) > before

    # A resumed trainer reads the online stream from its checkpoint's cursor: only the new
    # sample is trained, the accepted one not again.
    second = Trainer(
        online_trainer_config(eval=gate, max_steps=2), tmp_path, bus, Publisher(bus.js)
    )
    await second.setup()
    before = completion_logprob(second.model, rejected)
    await publish_online(bus, rejected)
    await second.run()
    assert completion_logprob(second.model, rejected) < before

    steps = read_steps(tmp_path)
    assert [s["sample_ids"] for s in read_samples(tmp_path)] == [["fb-accepted"], ["fb-rejected"]]
    assert [s["stream"] for s in steps] == ["online", "online"]
    assert [s["mean_reward"] for s in steps] == [0.75, -0.25]
    # The baseline of acme:chat: 0.75 after the first sample; the second used it and
    # updated it after (running mean of 0.75 and -0.25).
    assert steps[0]["online_baselines"] == {"acme:chat": 0.75}
    assert steps[1]["online_mean_advantage"] == pytest.approx(-1.0)
    assert steps[1]["online_baselines"] == {"acme:chat": pytest.approx(0.25)}
    checkpoint = latest_checkpoint(tmp_path / "trainer" / "checkpoints")
    assert checkpoint is not None and checkpoint.state.online_cursor.floor == 2

    # The gate judged the starting weights (first: promoted) and each trained version.
    found = await decisions(bus)
    assert [(d.version, d.promoted) for d in found] == [(0, True), (1, True), (3, True)]
    assert found[1].baseline_version == 0 and found[1].baseline_score == found[0].candidate_score
    kv = await bus.js.key_value(streams.STATE.bucket)
    assert (await kv.get(streams.PROMOTED_VERSION_KEY)).value == b"3"


async def test_stale_online_samples_are_dropped_and_impossible_ones_dead_lettered(
    bus: Bus, tmp_path: Path
) -> None:
    await provision(bus.js)
    kv = await bus.js.key_value(streams.STATE.bucket)
    await kv.put(streams.POLICY_VERSION_KEY, b"10")  # the trainer resumes at version 11
    online = OnlineConfig(fraction=1.0, stream_wait_s=0.0, batch_samples=4, max_staleness=0)
    trainer = Trainer(online_trainer_config(online=online), tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    await publish_online(bus, sample("future", version=30))  # no trainer made version 30
    await publish_online(bus, sample("no-logprobs", version=11, logprobs=[-1.0]))
    await publish_online(bus, sample("stale", version=5))
    await publish_online(bus, sample("fresh", version=11, signal="thumbs_down"))
    await trainer.run()
    (step,), (samples,) = read_steps(tmp_path), read_samples(tmp_path)
    assert samples["sample_ids"] == ["fresh"] and step["mean_reward"] == -0.5
    assert step["num_dropped"] == 1 and samples["dropped_ids"] == ["stale"]
    assert step["staleness"] == {"6": 1, "0": 1}
    # The impossible ones are consumed too, each with a dead letter saying why.
    assert trainer.state.online_cursor.floor == 4
    dead = await bus.js.stream_info(streams.DEAD_LETTERS.name)
    assert dead.state.messages == 2
    raws = [
        await bus.js.get_msg(streams.DEAD_LETTERS.name, seq=s)
        for s in (dead.state.first_seq, dead.state.last_seq)
    ]
    letters = [wire.decode(DeadLetter, raw.data or b"", None) for raw in raws]
    assert sorted((d.stream_sequence, d.consumer, d.reason) for d in letters) == [
        (1, "trainer-online", "invalid"),
        (2, "trainer-online", "invalid"),
    ]
    assert any("above the trainer's 11" in d.error for d in letters)


async def test_the_gate_records_promotions_and_rejections_with_scores(
    bus: Bus, arith_gateway: EnvClient
) -> None:
    client = arith_gateway
    await provision(bus.js)
    model = build_policy(POLICY)
    publisher = Publisher(bus.js)
    kv = await bus.js.key_value(streams.STATE.bucket)

    gate = EvalGate(
        EvalGateConfig(every_versions=2, num_tasks=6, margin=-0.5), POLICY, TOKENIZER, client
    )
    await gate.setup(bus.js)
    first = await gate.decide_on(model, 0, publisher, bus.js)
    assert (
        first is not None
        and first.promoted
        and first.baseline_version is None
        and first.num_tasks == 6
    )
    assert 0.0 <= first.candidate_score <= 1.0
    # A negative margin demands an improvement of 0.5 that the same weights cannot show.
    assert not gate.due(1) and gate.due(2)
    rejected = await gate.decide_on(model, 2, publisher, bus.js)
    assert (
        rejected is not None
        and not rejected.promoted
        and rejected.candidate_score == first.candidate_score
    )
    assert (rejected.baseline_version, rejected.baseline_score) == (0, first.candidate_score)
    assert rejected.margin == -0.5 and "<" in rejected.reason
    assert (await kv.get(streams.PROMOTED_VERSION_KEY)).value == b"0"

    # A restarted gate resumes from the last decision: what serves is still version 0.
    lenient = EvalGate(
        EvalGateConfig(every_versions=2, num_tasks=6, margin=0.02), POLICY, TOKENIZER, client
    )
    await lenient.setup(bus.js)
    assert lenient.last == rejected and not lenient.due(3)
    promoted = await lenient.decide_on(model, 4, publisher, bus.js)
    assert promoted is not None and promoted.promoted and promoted.baseline_version == 0
    assert (await kv.get(streams.PROMOTED_VERSION_KEY)).value == b"4"
    found = await decisions(bus)
    assert [(d.version, d.promoted) for d in found] == [(0, True), (2, False), (4, True)]


async def test_the_gate_runs_held_out_episodes_of_a_tool_env_through_env_gateway(
    bus: Bus,
) -> None:
    await provision(bus.js)
    model = build_policy(POLICY)
    publisher = Publisher(bus.js)
    config = EvalGateConfig(every_versions=1, num_tasks=3, env="calc")
    gate = EvalGate(config, POLICY, TOKENIZER, EnvClient(bus.nc))
    await gate.setup(bus.js)
    assert {task.env for task in gate.tasks} == {"calc"}
    # No gateway serves calc yet: nothing is decided, nothing promoted.
    assert await gate.decide_on(model, 0, publisher, bus.js) is None
    assert (await bus.js.stream_info(streams.PROMOTIONS.name)).state.messages == 0

    resets = {"env": "calc", "op": "reset", "outcome": "ok"}
    before = REGISTRY.get_sample_value("rlpipe_env_requests_total", resets)
    server = EnvServer(bus.nc, {"calc": make_env("calc")}, ServerLimits(step_timeout_s=30))
    await server.start()
    try:
        decision = await gate.decide_on(model, 1, publisher, bus.js)
    finally:
        await server.stop()
    after = REGISTRY.get_sample_value("rlpipe_env_requests_total", resets)
    assert (after or 0) - (before or 0) == 3  # one held-out episode per task
    assert decision is not None and decision.promoted and decision.num_tasks == 3
    assert 0.0 <= decision.candidate_score <= 1.0
    assert [d.version for d in await decisions(bus)] == [1]


async def test_a_serving_follower_applies_only_promoted_versions(bus: Bus, tmp_path: Path) -> None:
    await provision(bus.js)
    staging = tmp_path / "staging"
    broadcaster = WeightBroadcasterService(
        WeightBroadcasterSettings(staging_dir=staging, encode=EncodeOptions(threads=1))
    )
    await broadcaster.start(bus)
    broadcasting = asyncio.create_task(broadcaster.run())
    engine = HFEngine(build_policy(PolicyConfig(seed=99)), TOKENIZER)
    follower = WeightsFollower(
        engine,
        WeightReceiver(
            bus, trusting(fetch_timeout_s=5.0, promoted_only=True, decode_process=False)
        ),
        GenerationBatcher(engine),
        promoted_poll_s=0.05,
    )
    await follower.start(bus.js)
    following = asyncio.create_task(follower.run())
    kv = await bus.js.key_value(streams.STATE.bucket)
    staged = {v: build_policy(PolicyConfig(seed=v)).state_dict() for v in range(3)}
    try:
        publisher = Publisher(bus.js)
        for version in range(3):
            await stage_weights(publisher, staging, staged[version], version)
        await kv.put(streams.PROMOTED_VERSION_KEY, b"0")
        await wait_for(lambda: follower.has_version(0), timeout_s=30, what="version 0")
        assert engine.policy_version == 0
        await kv.put(streams.PROMOTED_VERSION_KEY, b"2")  # version 1 was never promoted
        await wait_for(lambda: follower.has_version(2), timeout_s=30, what="version 2")
        assert engine.policy_version == 2 and follower.num_applied == 2
        live = engine.model.state_dict()
        assert all(torch.equal(live[name], tensor) for name, tensor in staged[2].items())
    finally:
        following.cancel()
        await broadcaster.stop()
        await asyncio.wait_for(broadcasting, timeout=10)
