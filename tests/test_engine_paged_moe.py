"""The `paged` engine on mixture-of-experts models: the same tokens as transformers, and the
routing it records per position equals the routing of a teacher-forced transformers forward
over the same tokens, prefix-cache hits included.

CPU tests run the tiny-moe preset (Qwen3-MoE layers) in fp32, a small Mixtral and a small
Qwen3; `gpu` tests (grouped GEMMs in bf16, CUDA graphs, the moe-1b preset, a second GPU) skip
without CUDA:

    python -m pytest tests/test_engine_paged_moe.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.engine.model_runner import PrefillChunk
from libs.engine.moe_layers import (
    MoESpec,
    experts_grouped,
    experts_looped,
    grouped_mm_available,
    moe_spec,
    route,
    torch_gated,
)
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy
from libs.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
PROMPTS = [
    TOKENIZER.encode(text)
    for text in ("Q: 2+2=", "hello", "a longer prompt that spans more than two KV blocks: x=1")
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA GPU")
SMALL = {
    "vocab_size": TOKENIZER.vocab_size,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def tiny_moe(seed: int = 0) -> PreTrainedModel:
    return build_policy(PolicyConfig(preset="tiny-moe", device="cpu", seed=seed))


def small_model(model_type: str, **extra: object) -> PreTrainedModel:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SMALL, **extra)
    return AutoModelForCausalLM.from_config(config).eval()


def teacher_forced_routing(
    model: PreTrainedModel, prompt: list[int], c: Completion
) -> torch.Tensor:
    """Expert ids [P + G - 1, L, k] each MoE layer's router chose in one transformers forward
    over the tokens the engine fed (the prompt and all but the last sampled token)."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([prompt + c.token_ids[:-1]], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1).cpu()


def assert_routing_is_transformers(
    model: PreTrainedModel, prompts: list[list[int]], completions: list[Completion]
) -> None:
    for c in completions:
        prompt = prompts[c.prompt_index]
        assert c.routed_experts is not None
        assert c.routed_experts.dtype == torch.uint8 and c.routed_experts.device.type == "cpu"
        expected = teacher_forced_routing(model, prompt, c)
        assert c.routed_experts.shape == (len(prompt) + len(c.token_ids) - 1, *expected.shape[1:])
        assert torch.equal(c.routed_experts.long(), expected)


@pytest.mark.parametrize("eager_prefill_above", [None, 4], ids=["staged", "eager_prefill"])
def test_greedy_moe_tokens_and_routing_equal_transformers(eager_prefill_above: int | None) -> None:
    # Prompts prefilled inside the decode step, or eagerly in chunks: both record routing.
    model = tiny_moe()
    paged = PagedEngine(model, TOKENIZER, 64, eager_prefill_above=eager_prefill_above)
    got = paged.generate(PROMPTS, GREEDY, num_samples=2)
    expected = HFEngine(model, TOKENIZER, 64).generate(PROMPTS, GREEDY, num_samples=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert_routing_is_transformers(model, PROMPTS, got)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 3, "mlp_only_layers": [0]}),
        ("qwen3", {"head_dim": 16}),
    ],
    ids=["mixtral", "qwen3_moe_with_a_dense_layer", "qwen3_dense"],
)
def test_other_supported_families_decode_as_transformers(
    model_type: str, extra: dict[str, object]
) -> None:
    model = small_model(model_type, **extra)
    paged = PagedEngine(model, TOKENIZER, 16)
    got = paged.generate(PROMPTS, GREEDY)
    expected = HFEngine(model, TOKENIZER, 16).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    if model_type == "qwen3":
        assert all(c.routed_experts is None for c in got), "a dense model has no routing"
    else:
        assert_routing_is_transformers(model, PROMPTS, got)


def test_a_prefix_cache_hit_reports_the_routing_stored_with_the_shared_blocks() -> None:
    model = tiny_moe()
    paged = PagedEngine(model, TOKENIZER, 64)
    first_prompt = TOKENIZER.encode("an episode's first turn, long enough for several blocks. ")
    (first,) = paged.generate([first_prompt], GREEDY)
    second_prompt = first_prompt + first.token_ids + TOKENIZER.encode(" and the next turn")
    computed_before = paged.num_prefill_tokens
    (second,) = paged.generate([second_prompt], GREEDY)
    shared = len(second_prompt) - (paged.num_prefill_tokens - computed_before)
    assert shared >= 48, "the second turn must reuse the first turn's blocks"
    assert first.routed_experts is not None and second.routed_experts is not None
    assert torch.equal(second.routed_experts[:shared], first.routed_experts[:shared])
    assert_routing_is_transformers(model, [second_prompt], [second])


def test_a_weight_write_in_place_changes_what_the_moe_layers_compute() -> None:
    model = tiny_moe(seed=0)
    paged = PagedEngine(model, TOKENIZER, 64)
    before = paged.generate(PROMPTS, GREEDY)
    fresh = tiny_moe(seed=1)
    new_state = fresh.state_dict()
    live = paged.live_tensors()
    assert live is not None
    paged.write_in_place(lambda: [live[n].copy_(t) for n, t in new_state.items()], version=1)
    after = paged.generate(PROMPTS, GREEDY)
    expected = HFEngine(fresh, TOKENIZER, 64).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert_routing_is_transformers(fresh, PROMPTS, after)


def test_recording_off_gives_the_same_tokens_and_no_routing() -> None:
    model = tiny_moe()
    recorded = PagedEngine(model, TOKENIZER, 64).generate(PROMPTS, GREEDY)
    unrecorded = PagedEngine(model, TOKENIZER, 64, record_routing=False).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in unrecorded] == [c.token_ids for c in recorded]
    assert all(c.routed_experts is None for c in unrecorded)


def test_routing_costs_top_k_ids_per_moe_layer_per_token() -> None:
    spec = moe_spec(tiny_moe())
    assert spec is not None and spec.shape.bytes_per_token == 4 * 2  # 4 layers, top-2, uint8


def random_moe_layer(
    tokens: int, hidden: int, inner: int, experts: int, top_k: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Tokens [N, H], an experts module with gate_up/down weights, routing weights and ids."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(
        torch.randn(experts, 2 * inner, hidden, device=device, dtype=dtype) * hidden**-0.5
    )
    module.down_proj = torch.nn.Parameter(
        torch.randn(experts, hidden, inner, device=device, dtype=dtype) * inner**-0.5
    )
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    router = torch.randn(experts, hidden, device=device, dtype=dtype)
    spec = MoESpec(experts, top_k, normalize=True, weights_in_model_dtype=True, layers=(0,))
    weights, ids = route(x, router, spec)
    return x, module, weights, ids


def test_grouped_experts_equal_one_gemm_per_expert() -> None:
    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no grouped_mm on CPU")
    x, experts, weights, ids = random_moe_layer(50, 128, 96, 8, 2, "cpu", torch.float32)
    gated = lambda gate_up: torch_gated(torch.nn.functional.silu, gate_up)  # noqa: E731
    with torch.no_grad():
        grouped = experts_grouped(x, ids, weights, experts, gated)
        looped = experts_looped(x, ids, weights, experts, gated)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)


def sharpened(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its router weights scaled up 50x. At random init the router's logits are
    so close (std 0.64 over 48 experts: the 8th and 9th a median 0.04 apart) that bf16 rounding
    noise of any two correct implementations flips many choices; a trained router is far
    more decided. Sharpened, a correct path agrees with another on nearly every choice, and a
    wrong one (a position recorded at the wrong slot, a wrong weight layout) still does not."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(50.0)
    return model


@CUDA
def test_gpu_grouped_experts_match_the_per_expert_loop_in_bf16() -> None:
    device = torch.device("cuda")
    assert grouped_mm_available(device, torch.bfloat16), "an H100/H200 must take the fast path"
    x, experts, weights, ids = random_moe_layer(300, 1024, 384, 48, 8, "cuda", torch.bfloat16)
    gated = lambda gate_up: torch_gated(torch.nn.functional.silu, gate_up)  # noqa: E731
    with torch.no_grad():
        grouped = experts_grouped(x, ids, weights, experts, gated).float()
        looped = experts_looped(x, ids, weights, experts, gated).float()
    assert ((grouped - looped).norm() / looped.norm()) < 1e-2


@CUDA
def test_gpu_moe_in_fp32_runs_experts_one_by_one_and_decodes_as_transformers() -> None:
    # No grouped GEMM in fp32 on CUDA: the fused layers with one GEMM per expert, no graphs;
    # fp32 end to end, so tokens and routing equal transformers' (a logic error would not).
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_policy(PolicyConfig(preset="tiny-moe", device="cuda", dtype="float32"))
    model.set_experts_implementation("eager")  # the reference: torch's grouped GEMM is bf16
    paged = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536)
    assert paged.runner.fused is not None and paged.runner.moe is not None
    assert not paged.runner.moe.grouped and not paged.runner.uses_cuda_graphs
    got = paged.generate(PROMPTS, GREEDY, num_samples=2)
    expected = HFEngine(model, TOKENIZER, 64).generate(PROMPTS, GREEDY, num_samples=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert_routing_is_transformers(model, PROMPTS, got)


@CUDA
def test_gpu_fused_moe_layers_match_transformers_modules_in_bf16() -> None:
    model = sharpened(build_policy(PolicyConfig(preset="moe-1b", device="cuda")))
    paged = PagedEngine(model, TOKENIZER, 16, kv_cache_tokens=8192, use_cuda_graphs=False)
    chunk = [PrefillChunk(list(range(100, 250)), 0, [paged.pool.allocate() for _ in range(10)])]
    fused = paged.runner.prefill(chunk).float()
    paged.runner.fused = None  # the same chunk through transformers' modules
    plain = paged.runner.prefill(chunk).float()
    assert ((fused - plain).norm() / plain.norm()) < 3e-2


def routing_agreement(a: list[Completion], b: list[Completion]) -> float:
    """Fraction of (position, layer) expert sets equal between two greedy runs, over the
    positions before their tokens first differ."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        assert x.routed_experts is not None and y.routed_experts is not None
        pairs = enumerate(zip(x.token_ids, y.token_ids, strict=False))
        differ = next((i for i, (s, t) in pairs if s != t), len(x.token_ids))
        prompt_len = len(x.routed_experts) - len(x.token_ids) + 1
        length = min(prompt_len + differ, len(x.routed_experts), len(y.routed_experts))
        sets_x = x.routed_experts[:length].sort(dim=-1).values
        sets_y = y.routed_experts[:length].sort(dim=-1).values
        same += int((sets_x == sets_y).all(dim=-1).sum())
        total += sets_x.shape[0] * sets_x.shape[1]
    return same / max(total, 1)


@CUDA
def test_gpu_graph_decode_records_the_routing_of_eager_decode() -> None:
    model = sharpened(build_policy(PolicyConfig(preset="moe-1b", device="cuda")))  # bf16
    prompts = [list(range(10 + p, 74 + p)) for p in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    graphs = PagedEngine(model, TOKENIZER, 32, kv_cache_tokens=32768)
    assert graphs.runner.uses_cuda_graphs and graphs.runner.moe is not None
    assert graphs.runner.moe.grouped, "bf16 on an H200: grouped GEMMs, CUDA graphs"
    eager = PagedEngine(model, TOKENIZER, 32, kv_cache_tokens=32768, use_cuda_graphs=False)
    got = graphs.generate(prompts, params, num_samples=4)
    reference = eager.generate(prompts, params, num_samples=4)
    assert all(c.routed_experts is not None and c.routed_experts.shape[1:] == (16, 8) for c in got)
    assert routing_agreement(got, reference) >= 0.99


@CUDA
@TWO_GPUS
def test_gpu_moe_engine_runs_on_the_second_gpu() -> None:
    # The same seed gives bit-identical weights on any device: the engine on cuda:1 (while
    # the current device is cuda:0) decodes and routes as the one on cuda:0.
    prompts = [list(range(10 + p, 60 + p)) for p in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    runs = []
    for device in ("cuda:0", "cuda:1"):
        model = sharpened(build_policy(PolicyConfig(preset="moe-1b", device=device)))
        paged = PagedEngine(model, TOKENIZER, 16, kv_cache_tokens=16384)
        assert paged.runner.uses_cuda_graphs
        assert paged.runner.routing is not None and paged.runner.routing.ids.device == model.device
        runs.append(paged.generate(prompts, params, num_samples=2))
    assert routing_agreement(runs[1], runs[0]) >= 0.99
