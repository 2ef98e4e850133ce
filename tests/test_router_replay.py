"""Router replay from the worker to the trainer: the tiny-moe policy's rollouts carry the
experts the hf engine chose, through a real nats-server, into the trainer's step, whose
forwards use exactly those experts (libs.rollout.turn_routing, libs.trainer.router_replay)."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import PreTrainedModel

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import ensure_stream
from libs.bus.publisher import Publisher
from libs.domains.registry import make_env
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.envs.local_client import LocalEnvClient
from libs.moe.routing import NOT_RECORDED, record_routing, routers
from libs.moe.wire import decode_routing, encode_routing
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy
from libs.rl.online import OnlineBaselines, build_online_batch
from libs.rollout.agent import AgentRunner
from libs.rollout.episode import RunnerSettings
from libs.rollout.turn_routing import ROUTING_SIZE
from libs.serve.holds import generate_in_holds
from libs.tokenizer import ByteTokenizer
from libs.trainer.online_step import OnlineConfig, train_online_step
from libs.trainer.sharded import (
    leave_process_group,
    setup_process_group,
    shard_policy,
    sharded_train_step,
)
from libs.trainer.step import StepConfig, StepStats, prepare_batch, train_step
from proto import streams
from proto.messages import (
    FeedbackEvent,
    OnlineSample,
    Rollout,
    SamplingSettings,
    ScoredRollout,
    ServedGeneration,
)
from proto.subjects import rollout_raw_subject

TOKENIZER = ByteTokenizer()
SAMPLES = list[ScoredRollout]


def tiny_moe() -> PreTrainedModel:
    return build_policy(PolicyConfig(preset="tiny-moe", device="cpu"))


async def moe_rollouts(model: PreTrainedModel, group_size: int = 4) -> list[Rollout]:
    """One arith group rolled out by the real harness on an hf engine over `model`."""
    engine = HFEngine(model, TOKENIZER)
    env = make_env("arith")
    task = env.task_source(difficulty=0, group_size=group_size, seed=3).task(0)

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return await asyncio.to_thread(engine.generate, prompts, params)

    runner = AgentRunner(
        LocalEnvClient({"arith": env}), TOKENIZER, generate, RunnerSettings(worker_id="moe")
    )
    return await runner.run(task)


async def through_the_bus(bus: Bus, rollouts: list[Rollout]) -> list[Rollout]:
    """Publish `rollouts` on the raw-rollout stream and read them back as reward would."""
    await ensure_stream(bus.js, streams.ROLLOUTS_RAW)
    publisher = Publisher(bus.js)
    for rollout in rollouts:
        await publisher.publish(rollout_raw_subject("arith"), rollout, rollout.rollout_id)
    info = await bus.js.stream_info(streams.ROLLOUTS_RAW.name)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(streams.ROLLOUTS_RAW.name, seq)
        out.append(wire.decode(Rollout, raw.data or b"", dict(raw.headers or {})))
    return out


def experts_used(model: nn.Module) -> list[torch.Tensor]:
    """Filled with the expert ids every MoE layer's experts run on, forward by forward."""
    used: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda _m, args: used.append(args[1].detach()))
    return used


def perturb_routers(model: PreTrainedModel, scale: float) -> None:
    """The trainer's numerics made to differ: a fixed noise vector on every router's input
    (the same at every position, so any split of the rows sees the same perturbation)."""
    hidden_size = int(model.config.hidden_size)
    noise = scale * torch.randn(hidden_size, generator=torch.Generator().manual_seed(0))
    for router in routers(model):
        router.register_forward_pre_hook(lambda _m, args: (args[0] + noise,))


def train(model: PreTrainedModel, samples: list[ScoredRollout], config: StepConfig) -> StepStats:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return train_step(model, optimizer, samples, 0, config, TOKENIZER.pad_id)


@pytest.fixture(scope="module")
def engine_model() -> PreTrainedModel:
    return tiny_moe()


@pytest.fixture(scope="module")
def rollouts(engine_model: PreTrainedModel) -> list[Rollout]:
    return asyncio.run(moe_rollouts(engine_model))


def scored(rollouts: list[Rollout]) -> list[ScoredRollout]:
    return [ScoredRollout(rollout=r, reward=float(i % 2)) for i, r in enumerate(rollouts)]


async def test_routing_recorded_by_the_worker_round_trips_the_bus(
    bus: Bus, rollouts: list[Rollout]
) -> None:
    received = await through_the_bus(bus, rollouts)
    assert len(received) == len(rollouts)
    # What the worker's gauges report: tiny-moe's 4 layers x top-2 uint8 ids, 8 B a token raw.
    assert ROUTING_SIZE.num_tokens > 0
    assert ROUTING_SIZE.raw_bytes == 8 * ROUTING_SIZE.num_tokens
    assert ROUTING_SIZE.wire_bytes <= ROUTING_SIZE.raw_bytes
    for sent, got in zip(rollouts, received, strict=True):
        tokens = sum(len(turn.token_ids) for turn in got.turns)
        routed = [turn.routed_experts for turn in got.turns]
        assert all(r is not None for r in routed)
        # Every position but the episode's last sampled token was fed through the model.
        assert sum(r.num_tokens for r in routed if r is not None) == tokens - 1
        for a, b in zip(sent.turns, got.turns, strict=True):
            assert a.routed_experts is not None and b.routed_experts is not None
            assert torch.equal(decode_routing(a.routed_experts), decode_routing(b.routed_experts))
            assert decode_routing(b.routed_experts).shape[1:] == (4, 2)


def test_the_trainer_replays_exactly_the_recorded_experts(
    engine_model: PreTrainedModel, rollouts: list[Rollout]
) -> None:
    model = copy.deepcopy(engine_model)
    perturb_routers(model, scale=0.3)
    used = experts_used(model)
    samples = scored(rollouts)
    stats = train(model, samples, StepConfig())
    _, batch = prepare_batch(model, samples, StepConfig(), TOKENIZER.pad_id)
    recorded = batch.routed_experts
    assert recorded is not None
    # The last forward is the loss forward: per layer, [B * T, k] experts run.
    loss_forward = torch.stack(used[-4:], dim=1).view(recorded.shape)
    has_record = recorded >= 0
    assert torch.equal(loss_forward[has_record], recorded[has_record].long())
    assert (recorded == NOT_RECORDED).any()  # padding and the last tokens: own routing
    assert stats.routing_disagreement is not None and stats.routing_disagreement > 0
    gates = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert all(gate.grad is not None and gate.grad.abs().sum() > 0 for gate in gates)


def test_disagreement_is_measured_without_replay_and_vanishes_unperturbed(
    engine_model: PreTrainedModel, rollouts: list[Rollout]
) -> None:
    samples = scored(rollouts)
    perturbed = copy.deepcopy(engine_model)
    perturb_routers(perturbed, scale=0.3)
    used = experts_used(perturbed)
    off = train(perturbed, samples, StepConfig(router_replay=False))
    assert off.routing_disagreement is not None and off.routing_disagreement > 0
    _, batch = prepare_batch(perturbed, samples, StepConfig(), TOKENIZER.pad_id)
    assert batch.routed_experts is not None
    loss_forward = torch.stack(used[-4:], dim=1).view(batch.routed_experts.shape)
    has_record = batch.routed_experts >= 0
    assert not torch.equal(loss_forward[has_record], batch.routed_experts[has_record].long())
    same = train(copy.deepcopy(engine_model), samples, StepConfig())
    assert same.routing_disagreement is not None and same.routing_disagreement < 0.01


def test_replay_on_a_dense_policy_is_refused_with_the_setting_named(
    rollouts: list[Rollout],
) -> None:
    dense = build_policy(PolicyConfig(device="cpu"))
    with pytest.raises(ValueError, match="router_replay"):
        train(dense, scored(rollouts), StepConfig(router_replay=True))


WORLD = 2


def run_rank(rank: int, port: int, out: Path) -> None:
    """One FSDP2 rank over gloo: the sharded step on the samples saved in `out`."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    setup_process_group(torch.device("cpu"))
    try:
        samples = msgspec.msgpack.decode((out / "samples.msgpack").read_bytes(), type=SAMPLES)
        model = shard_policy(tiny_moe())
        perturb_routers(model, scale=0.3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stats = sharded_train_step(model, optimizer, samples, 0, StepConfig(), TOKENIZER.pad_id)
        if rank == 0:
            torch.save(stats, out / "stats.pt")
        leave_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_fsdp_ranks_replay_the_routing_like_one(
    tmp_path: Path, rollouts: list[Rollout]
) -> None:
    samples = scored(rollouts)
    (tmp_path / "samples.msgpack").write_bytes(msgspec.msgpack.encode(samples))
    model = tiny_moe()
    perturb_routers(model, scale=0.3)
    reference = train(model, samples, StepConfig())
    mp.spawn(run_rank, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    sharded: StepStats = torch.load(tmp_path / "stats.pt", weights_only=False)
    assert abs(sharded.loss - reference.loss) < 1e-5
    assert sharded.routing_disagreement == reference.routing_disagreement


async def test_a_served_generation_carries_its_routing_into_the_online_step() -> None:
    """Serve mode decodes in holds; the served record carries the routing of prompt and
    completion through the feedback join (OnlineSample embeds it) into the online step."""
    model = tiny_moe()
    engine = HFEngine(model, TOKENIZER)

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return await asyncio.to_thread(engine.generate, prompts, params)

    prompt = TOKENIZER.encode("Q: 3+4=")
    params = SamplingParams(max_tokens=10, seed=2, stop_token_ids=())
    (completion,) = await generate_in_holds(
        generate, prompt, 1, params, hold_tokens=3, tokenizer=TOKENIZER
    )
    assert completion.routed_experts is not None
    fed = [*prompt, *completion.token_ids][:-1]
    with torch.no_grad(), record_routing(model) as recorder:
        model(input_ids=torch.tensor([fed]), use_cache=False)
    expected = recorder.take(batch_size=1)[0]
    assert torch.equal(completion.routed_experts.sort(-1).values, expected.sort(-1).values)

    generation = ServedGeneration(
        generation_id="g1",
        policy_version=0,
        prompt_token_ids=prompt,
        completion_token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        sampling=SamplingSettings(),
        routed_experts=encode_routing(completion.routed_experts),
    )
    event = FeedbackEvent(
        event_id="e1", generation_id="g1", product="app", signal="accepted", occurred_at=1.0
    )
    sample = OnlineSample(sample_id="e1", generation=generation, feedback=event)
    sample = wire.decode(OnlineSample, wire.encode(sample), None)  # as the trainer reads it
    batch = build_online_batch([sample], [1.0], pad_id=TOKENIZER.pad_id)
    assert batch.routed_experts is not None
    expected_sets = completion.routed_experts.sort(-1).values.short()
    assert torch.equal(batch.routed_experts[0, : len(fed)], expected_sets)
    assert (batch.routed_experts[0, len(fed) :] == NOT_RECORDED).all()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stats = train_online_step(
        model, optimizer, [sample], OnlineBaselines(), 0, StepConfig(), OnlineConfig(), 0
    )
    assert stats.routing_disagreement == 0.0  # the same weights route the same way
