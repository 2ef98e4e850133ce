"""MoE routing on the tiny-moe preset: recorded by the hf engine, compact on the wire,
replayed by the trainer's forward (libs.moe)."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from libs.engine.base import SamplingParams
from libs.engine.factory import EngineConfig, build_engine
from libs.engine.hf import HFEngine
from libs.moe.routing import NOT_RECORDED, moe_shape, record_routing, replay_routing, routers
from libs.moe.wire import decode_routing, encode_routing, routing_bytes
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.rollout.turn_routing import EpisodeRouting
from libs.tokenizer import ByteTokenizer
from proto.messages import Turn

TOKENIZER = ByteTokenizer()
PROMPTS = [TOKENIZER.encode(text) for text in ("Q: 12+7=", "hello there", "x")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def tiny_moe(seed: int = 0) -> PreTrainedModel:
    return build_policy(PolicyConfig(preset="tiny-moe", device="cpu", seed=seed))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that run the chosen experts, `experts(hidden, top_k_index, weights)`."""
    return [module for name, module in model.named_modules() if name.endswith("mlp.experts")]


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(tiny_moe(), TOKENIZER)


def teacher_forced_routing(model: nn.Module, sequence: list[int]) -> torch.Tensor:
    """Routing [len(sequence), L, k] of one unpadded forward over `sequence`."""
    ids = torch.tensor([sequence])
    with torch.no_grad(), record_routing(model) as recorder:
        model(input_ids=ids, use_cache=False)
    return recorder.take(batch_size=1)[0]


def test_moe_shape_of_the_presets_and_the_bytes_per_token() -> None:
    shape = moe_shape(tiny_moe())
    assert shape is not None and (shape.num_layers, shape.top_k, shape.num_experts) == (4, 2, 8)
    assert shape.dtype == torch.uint8 and shape.bytes_per_token == 8
    assert moe_shape(build_policy(PolicyConfig(preset="tiny", device="cpu"))) is None


def test_engine_routing_equals_a_teacher_forced_forward(engine: HFEngine) -> None:
    completions = engine.generate(PROMPTS, GREEDY, num_samples=2)
    for completion in completions:
        prompt = PROMPTS[completion.prompt_index]
        routed = completion.routed_experts
        assert routed is not None and routed.dtype == torch.uint8
        fed = [*prompt, *completion.token_ids][:-1]  # the last sampled token is never fed
        assert routed.shape == (len(fed), 4, 2)
        expected = teacher_forced_routing(engine.model, fed)
        assert torch.equal(routed.sort(-1).values, expected.sort(-1).values)


def test_a_continued_call_carries_the_routing_of_its_cached_prefix(engine: HFEngine) -> None:
    """Serve mode's holds: the second call reuses the first call's KV (continuation cache)
    and its routing covers the whole prompt, as recorded when that KV was computed."""
    cut = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=())
    first = engine.generate([PROMPTS[1]], cut)[0]
    assert first.finish_reason == "length"
    continued_prompt = [*PROMPTS[1], *first.token_ids]
    second = engine.generate([continued_prompt], cut)[0]
    assert second.routed_experts is not None and first.routed_experts is not None
    fed = [*continued_prompt, *second.token_ids][:-1]
    assert second.routed_experts.shape[0] == len(fed)
    assert torch.equal(second.routed_experts[: first.routed_experts.shape[0]], first.routed_experts)
    expected = teacher_forced_routing(engine.model, fed)
    assert torch.equal(second.routed_experts.sort(-1).values, expected.sort(-1).values)


def test_dense_models_record_no_routing() -> None:
    dense = HFEngine(build_policy(PolicyConfig(device="cpu")), TOKENIZER)
    assert dense.generate([PROMPTS[0]], GREEDY)[0].routed_experts is None


def test_routing_round_trips_the_wire_codec_compressed() -> None:
    ids = torch.randint(0, 8, (50, 4, 2), dtype=torch.uint8)
    ids[10:40] = ids[10]  # a run of tokens routed alike compresses
    routed = encode_routing(ids)
    assert torch.equal(decode_routing(routed), ids.sort(-1).values)  # expert sets kept
    raw, wire = routing_bytes(routed)
    assert raw == 50 * 8 and wire < raw
    short = encode_routing(ids[:2])  # a frame's header would cost more than it saves
    assert short.codec == "raw" and routing_bytes(short) == (16, 16)
    assert torch.equal(decode_routing(short), ids[:2].sort(-1).values)
    wide = torch.randint(0, 300, (5, 3, 4), dtype=torch.int16)
    assert torch.equal(decode_routing(encode_routing(wide)), wide.sort(-1).values)


def test_replay_routes_to_exactly_the_recorded_experts_and_the_router_learns() -> None:
    model = tiny_moe()
    ids = torch.randint(3, 200, (2, 9))
    mask = torch.ones_like(ids)
    shape = moe_shape(model)
    assert shape is not None
    recorded = torch.randint(0, 8, (2, 9, shape.num_layers, 1))
    recorded = torch.cat([recorded, (recorded + 1 + torch.randint(0, 7, recorded.shape)) % 8], -1)
    recorded[1, 6:] = NOT_RECORDED  # padding / unreported positions keep their own choice
    recorded[1, 7, 0, 0] = 200  # no such expert: a corrupt record, the router's own choice too
    seen: list[torch.Tensor] = []
    hooks = [
        router.register_forward_hook(lambda _m, _a, out: seen.append(out[2].detach()))
        for router in routers(model)
    ]
    experts_seen: list[torch.Tensor] = []
    for experts in experts_modules(model):
        experts.register_forward_pre_hook(lambda _m, args: experts_seen.append(args[1].detach()))
    with replay_routing(model, recorded) as trace:
        logprobs = sequence_logprobs(model, ids, mask)
    for hook in hooks:
        hook.remove()
    own = torch.stack(seen, 1).view(2, 9, shape.num_layers, 2)  # before replay's swap
    used = torch.stack(experts_seen, 1).view(2, 9, shape.num_layers, 2)
    assert torch.equal(used[0], recorded[0]) and torch.equal(used[1, :6], recorded[1, :6])
    assert torch.equal(used[1, 6:], own[1, 6:])
    assert trace.disagreement is not None and trace.disagreement > 0.5  # random records
    logprobs[:, 2:].sum().backward()
    gates = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert len(gates) == shape.num_layers
    assert all(gate.grad is not None and gate.grad.abs().sum() > 0 for gate in gates)


def test_a_perturbed_trainer_flips_routes_without_replay_and_none_with_it() -> None:
    """Noise on the router input (the trainer's numerics differing from the engine's)."""
    model = tiny_moe()
    engine = HFEngine(model, TOKENIZER)
    completion = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, seed=1))[0]
    assert completion.routed_experts is not None
    fed = [*PROMPTS[0], *completion.token_ids][:-1]
    ids = torch.tensor([fed])
    recorded = completion.routed_experts.unsqueeze(0)
    generator = torch.Generator().manual_seed(0)
    noise = [
        router.register_forward_pre_hook(
            lambda _m, args: (args[0] + 0.3 * torch.randn(args[0].shape, generator=generator),)
        )
        for router in routers(model)
    ]
    used: list[torch.Tensor] = []
    for experts in experts_modules(model):
        experts.register_forward_pre_hook(lambda _m, args: used.append(args[1]))
    with torch.no_grad(), replay_routing(model, recorded, replay=False) as own:
        sequence_logprobs(model, ids, torch.ones_like(ids))
    assert own.disagreement is not None and own.disagreement > 0
    used.clear()
    with torch.no_grad(), replay_routing(model, recorded):
        sequence_logprobs(model, ids, torch.ones_like(ids))
    replayed_ids = torch.stack(used, 1).view(recorded.shape)
    assert torch.equal(replayed_ids, recorded.long())  # no flipped route reaches an expert
    for hook in noise:
        hook.remove()


@pytest.mark.parametrize(
    "model_type, experts_key",
    [("mixtral", "num_local_experts"), ("qwen2_moe", "num_experts")],
)
def test_other_families_record_and_replay(model_type: str, experts_key: str) -> None:
    config = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
        **{experts_key: 4},
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad(), record_routing(model) as recorder:
        expected = model(input_ids=ids).logits
    routed = recorder.take(batch_size=2)
    assert routed.shape == (2, 5, 2, 2)
    with torch.no_grad(), replay_routing(model, routed) as trace:
        replayed = model(input_ids=ids).logits
    assert trace.disagreement == 0.0
    torch.testing.assert_close(replayed, expected)  # gate weights recomputed as the family does


def test_an_episode_keeps_each_position_s_first_routing_across_turns_and_segments() -> None:
    """Turns [user 5][assistant 3][tool 4][assistant 2] in segment 0, then [user 3]
    [assistant 2] in segment 1: each engine call reports prompt + completion - 1 positions."""
    layout: list[tuple[Literal["user", "assistant", "tool"], int, int]] = [
        ("user", 5, 0),
        ("assistant", 3, 0),
        ("tool", 4, 0),
        ("assistant", 2, 0),
        ("user", 3, 1),
        ("assistant", 2, 1),
    ]
    turns = [Turn(role=role, token_ids=[1] * n, segment=segment) for role, n, segment in layout]
    first = torch.full((7, 4, 2), 1, dtype=torch.uint8)  # call 1: 5 prompt + 3 sampled - 1
    second = torch.full((13, 4, 2), 2, dtype=torch.uint8)  # call 2: 12 prompt + 2 - 1
    third = torch.full((4, 4, 2), 3, dtype=torch.uint8)  # segment 1: 3 + 2 - 1
    routing = EpisodeRouting()
    routing.add(0, first)
    routing.add(0, second)
    routing.add(1, third)
    routing.attach(turns)
    pieces = [decode_routing(t.routed_experts)[:, 0, 0].tolist() for t in turns if t.routed_experts]
    assert pieces == [[1] * 5, [1, 1, 2], [2] * 4, [2], [3] * 3, [3]]


@pytest.mark.parametrize("engine_type", ["hf", "paged"])
def test_engine_config_turns_routing_recording_off(engine_type: Literal["hf", "paged"]) -> None:
    """`engine.record_routing` reaches both local engines built from config: on (the
    default) every completion carries its routing, off none does and the tokens stay the
    same (recording only reads the router's choice)."""
    policy = PolicyConfig(preset="tiny-moe", device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    got = {}
    for record in (True, False):
        config = EngineConfig(type=engine_type, max_batch_rows=8, record_routing=record)
        got[record] = build_engine(config, policy, tiny_moe()).generate(prompts, params, 2)
    assert all(c.routed_experts is not None for c in got[True])
    assert all(c.routed_experts is None for c in got[False])
    assert [c.token_ids for c in got[True]] == [c.token_ids for c in got[False]]
