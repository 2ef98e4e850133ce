"""The `paged` engine: same tokens as `hf`, continuous batching, prefix sharing, weight swaps.

CPU tests run the engine's eager path on the tiny preset; `gpu` tests (CUDA graphs, the
Triton kernels, bf16 qwen2-0.5b) skip without a CUDA device.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from libs.engine import paged_attention
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.engine.model_runner import PrefillChunk
from libs.engine.paged import PagedEngine
from libs.engine.paged_attention import AttentionPlan, chunk_attention, decode_attention
from libs.engine.row_sampling import sample_rows_torch, sample_rows_triton, step_seeds
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
PROMPTS = [
    TOKENIZER.encode(text)
    for text in ("Q: 2+2=", "hello", "a longer prompt that spans more than two KV blocks: x=1")
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_paged(seed: int = 0, **kwargs: object) -> PagedEngine:
    model = build_policy(PolicyConfig(device="cpu", seed=seed))
    return PagedEngine(model, TOKENIZER, 64, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> PagedEngine:
    return make_paged()


def tokens(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


def wait_for(condition: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.001)


def test_greedy_completions_equal_the_hf_engines(engine: PagedEngine) -> None:
    reference = HFEngine(engine.model, TOKENIZER, max_batch_rows=64)
    expected = reference.generate(PROMPTS, GREEDY, num_samples=2)
    got = engine.generate(PROMPTS, GREEDY, num_samples=2)
    assert tokens(got) == tokens(expected)
    assert [(c.prompt_index, c.sample_index) for c in got] == [
        (p, s) for p in range(3) for s in range(2)
    ]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.raw_logprobs == pytest.approx(theirs.raw_logprobs, abs=1e-4)
        assert mine.logprobs == [0.0] * len(mine.token_ids)


def test_a_row_that_joins_mid_batch_decodes_as_it_would_alone(engine: PagedEngine) -> None:
    alone = tokens(engine.generate(PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=8)))
    long_params = SamplingParams(temperature=0.0, max_tokens=200, stop_token_ids=())
    results: dict[str, list[Completion]] = {}
    first = threading.Thread(
        target=lambda: results.setdefault("long", engine.generate(PROMPTS[:2], long_params, 3))
    )
    first.start()
    steps_before = engine.num_steps
    wait_for(lambda: engine.num_steps >= steps_before + 5)
    assert "long" not in results, "the long request must still be running when the next joins"
    joined = engine.generate(PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=8))
    assert "long" not in results, "the short request left while the long one kept decoding"
    first.join()
    assert tokens(joined) == alone
    long_alone = engine.generate(PROMPTS[:2], long_params, 3)
    assert tokens(results["long"]) == tokens(long_alone)


def test_seeded_samples_do_not_depend_on_the_rest_of_the_batch(engine: PagedEngine) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=7)
    alone = engine.generate(PROMPTS[:1], params, num_samples=4)
    again = engine.generate(PROMPTS[:1], params, num_samples=4)
    crowd: list[list[Completion]] = []
    other = threading.Thread(
        target=lambda: crowd.append(engine.generate(PROMPTS, SamplingParams(max_tokens=40), 8))
    )
    other.start()
    together = engine.generate(PROMPTS[:1], params, num_samples=4)
    other.join()
    assert tokens(alone) == tokens(again) == tokens(together)
    assert len({tuple(t) for t in tokens(alone)}) > 1, "a group's samples must differ"


def test_sampled_logprobs_are_the_trainers_recomputation(engine: PagedEngine) -> None:
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=16, seed=3), num_samples=4)
    sequences = [PROMPTS[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), TOKENIZER.pad_id)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    with torch.no_grad():
        trainer = sequence_logprobs(engine.model, ids, mask)
    for row, c in enumerate(completions):
        start = len(PROMPTS[c.prompt_index]) - 1
        recomputed = trainer[row, start : start + len(c.token_ids)].tolist()
        assert c.raw_logprobs == pytest.approx(recomputed, abs=1e-4)
        assert c.logprobs == pytest.approx(c.raw_logprobs, abs=1e-5)  # T=1, top_p=1


def test_temperature_and_top_p_logprobs_are_under_the_sampling_distribution() -> None:
    logits = torch.randn(6, 50, dtype=torch.float64).float() * 3
    temperatures = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.7])
    top_ps = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0, 0.9])
    sampled = sample_rows_torch(
        logits, temperatures, top_ps, step_seeds(torch.arange(6), torch.zeros(6, dtype=torch.long))
    )
    assert sampled.token_ids[0] == logits[0].argmax() and sampled.logprobs[0] == 0.0
    for row in range(1, 6):
        dist = (logits[row] / temperatures[row]).log_softmax(-1)
        if top_ps[row] < 1:
            from libs.engine.sampling import nucleus_logprobs

            dist = nucleus_logprobs(dist[None], float(top_ps[row]))[0]
        token = sampled.token_ids[row]
        assert torch.isfinite(dist[token]), "a token outside the nucleus was drawn"
        assert sampled.logprobs[row] == pytest.approx(float(dist[token]), abs=1e-5)
        assert sampled.raw_logprobs[row] == pytest.approx(
            float(logits[row].log_softmax(-1)[token]), abs=1e-5
        )


def test_the_gumbel_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    seeds = step_seeds(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    sampled = sample_rows_torch(logits, torch.ones(20000), torch.ones(20000), seeds)
    freq = torch.bincount(sampled.token_ids, minlength=4).double() / 20000
    assert torch.allclose(freq, logits[0].double().softmax(-1), atol=0.015)


def test_prefix_sharing_gives_the_same_tokens_and_skips_the_shared_prompt() -> None:
    prompt = TOKENIZER.encode("a GRPO group shares this prompt of many bytes: " * 3)
    unshared = make_paged()
    expected = [unshared.generate([prompt], GREEDY)[0].token_ids for _ in range(1)]
    sharing = make_paged()
    computed_before = sharing.num_prefill_tokens
    group = sharing.generate([prompt], GREEDY, num_samples=8)
    assert tokens(group) == expected * 8
    computed = sharing.num_prefill_tokens - computed_before
    assert computed < 2 * len(prompt), f"8 samples computed {computed} prompt tokens"
    # An episode's next turn: the earlier turn (prompt + completion) is shared.
    turn = prompt + group[0].token_ids + TOKENIZER.encode(" tool says 4. ")
    before = sharing.num_prefill_tokens
    second = sharing.generate([turn], GREEDY)
    assert sharing.num_prefill_tokens - before <= len(turn) - len(prompt)
    assert tokens(second) == tokens(make_paged().generate([turn], GREEDY))


def test_prompts_staged_in_the_decode_step_decode_as_eager_prefills() -> None:
    # Staged: prompts computed as extra rows of the decode step (default for short prompts),
    # 8 prompt tokens a step at most here, so long prompts take several steps beside the
    # decoding rows. Eager: every prompt through the separate prefill forward.
    staged = make_paged(staged_prefill_tokens=8)
    eager = make_paged(eager_prefill_above=1)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    for engine in (staged, eager):
        engine.generate(PROMPTS, GREEDY)  # leaves cached prefixes behind, as in service
    results: dict[str, list[list[int]]] = {}
    for name, engine in (("staged", staged), ("eager", eager)):
        crowd: list[list[Completion]] = []
        other = threading.Thread(
            target=lambda e=engine, out=crowd: out.append(e.generate(PROMPTS, GREEDY, 3))
        )
        other.start()
        mine = engine.generate(PROMPTS[::-1], sampled, num_samples=2)
        other.join()
        results[name] = tokens(crowd[0]) + tokens(mine)
    assert results["staged"] == results["eager"]
    assert staged.timings_s["prefill"] == 0.0, "no eager prefill when every prompt is short"
    assert eager.timings_s["prefill"] > 0.0


def test_a_weight_update_between_steps_acts_as_a_fresh_model(engine: PagedEngine) -> None:
    local = make_paged(seed=0)
    prompt = [PROMPTS[2]]
    local.generate(prompt, GREEDY, num_samples=2)  # leaves the prompt's blocks cached
    new_state = build_policy(PolicyConfig(device="cpu", seed=1)).state_dict()
    pause_s = local.update_weights(new_state, version=1)
    assert pause_s >= 0 and local.policy_version == 1
    fresh = make_paged(seed=1)
    after = local.generate(prompt, GREEDY, num_samples=2)
    assert tokens(after) == tokens(fresh.generate(prompt, GREEDY, num_samples=2))
    assert all(c.policy_version == 1 for c in after)
    # In place through live_tensors, as the weights follower writes.
    back = build_policy(PolicyConfig(device="cpu", seed=0)).state_dict()
    live = local.live_tensors()
    assert live is not None
    _, pause_s = local.write_in_place(lambda: [live[k].copy_(v) for k, v in back.items()], 2)
    assert tokens(local.generate(prompt, GREEDY, num_samples=2)) == tokens(
        engine.generate(prompt, GREEDY, num_samples=2)
    )
    with pytest.raises(ValueError, match="older"):
        local.update_weights(back, version=1)


def test_weights_changed_outside_the_engine_are_seen_by_the_next_call() -> None:
    shared = build_policy(PolicyConfig(device="cpu", seed=0))  # as the trainer's eval gate
    local = PagedEngine(shared, TOKENIZER, 64)
    prompt = [PROMPTS[2]]
    local.generate(prompt, GREEDY, num_samples=2)  # caches the prompt's blocks
    with torch.no_grad():  # an optimizer step on the shared model, not through the engine
        for name, tensor in build_policy(PolicyConfig(device="cpu", seed=1)).state_dict().items():
            shared.state_dict()[name].copy_(tensor)
    expected = make_paged(seed=1).generate(prompt, GREEDY, num_samples=2)
    assert tokens(local.generate(prompt, GREEDY, num_samples=2)) == tokens(expected)


def test_a_weight_write_waits_for_running_calls(engine: PagedEngine) -> None:
    local = make_paged()
    live = local.live_tensors()
    assert live is not None
    running = local.submit(PROMPTS, SamplingParams(temperature=0.0, max_tokens=150))
    wait_for(lambda: local.num_steps > 2)
    local.write_in_place(lambda: None, version=5)
    assert running.done(), "the write started before the running call finished"
    assert all(c.policy_version == 0 for c in running.result())


def test_a_call_submitted_during_a_weight_write_runs_on_the_new_weights(
    engine: PagedEngine,
) -> None:
    local = make_paged(seed=0)
    live = local.live_tensors()
    assert live is not None
    new_state = build_policy(PolicyConfig(device="cpu", seed=1)).state_dict()
    submitted: list[Future[list[Completion]]] = []

    def write() -> None:
        for name, tensor in new_state.items():
            live[name].copy_(tensor)
        # Submitting returns at once (no wait on the write); the call joins after it.
        submitted.append(local.submit([PROMPTS[2]], GREEDY, num_samples=2))
        assert not submitted[0].done()

    local.write_in_place(write, version=3)
    after = submitted[0].result(timeout=60)
    assert all(c.policy_version == 3 for c in after)
    expected = make_paged(seed=1).generate([PROMPTS[2]], GREEDY, num_samples=2)
    assert tokens(after) == tokens(expected)
    # A future the caller gave up on still ends (the engine resolves what it started).
    given_up = local.submit([PROMPTS[0]], GREEDY)
    assert not given_up.cancel()
    assert len(given_up.result(timeout=60)) == 1


def test_stops_and_lengths_are_reported(engine: PagedEngine) -> None:
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(free[5],))
    )[0]
    assert stopped.token_ids == free[: free.index(free[5]) + 1] and stopped.finish_reason == "stop"
    text = TOKENIZER.decode(free[3:6])
    by_string = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop_strings=(text,))
    )[0]
    assert (
        TOKENIZER.decode(by_string.token_ids).endswith(text) and by_string.finish_reason == "stop"
    )
    capped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert capped.token_ids == free[:3] and capped.finish_reason == "length"


def test_requests_that_cannot_fit_are_refused_clearly() -> None:
    small = make_paged(kv_cache_tokens=64)
    with pytest.raises(ValueError, match="max_tokens"):
        small.generate(PROMPTS[:1], SamplingParams(max_tokens=100))
    assert len(small.generate(PROMPTS[:1], SamplingParams(max_tokens=20), num_samples=6)) == 6
    with pytest.raises(ValueError, match="paged engine runs"):
        config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=300)
        PagedEngine(AutoModelForCausalLM.from_config(config), TOKENIZER)


def test_the_batcher_hands_requests_over_as_they_come(engine: PagedEngine) -> None:
    from libs.rollout.batcher import GenerationBatcher  # the bus stack; GPU runs skip this

    async def scenario() -> tuple[list[Completion], list[Completion]]:
        batcher = GenerationBatcher(engine)
        batcher.open.set()
        running = asyncio.create_task(batcher.run())
        long = asyncio.create_task(
            batcher.generate([PROMPTS[0]] * 2, SamplingParams(temperature=0.0, max_tokens=120))
        )
        await asyncio.sleep(0.05)
        short = await batcher.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8))
        assert not long.done(), "the short request waited for the long one"
        async with batcher.gate:  # the weights follower's swap: waits for the running calls
            assert long.done()
        result = await long
        running.cancel()
        return short, result

    short, long = asyncio.run(scenario())
    assert tokens(short) == tokens(
        engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8))
    )
    assert tokens(long) == tokens(
        engine.generate([PROMPTS[0]] * 2, SamplingParams(temperature=0.0, max_tokens=120))
    )


def test_a_continuous_batcher_gives_the_gate_back_when_its_last_call_ends() -> None:
    # The batcher wakes on arrivals, on a swap wanting the gate, and when its last running
    # call ends (not on every call): idle, it must hold neither the gate nor a call.
    from libs.rollout.batcher import GenerationBatcher

    class Sleeping:
        continuous_batching = True
        policy_version = 0

        def submit(self, prompts, params, num_samples=1):  # type: ignore[no-untyped-def]
            future: Future[list[Completion]] = Future()

            def answer() -> None:
                time.sleep(0.05 * len(prompts))
                done = [Completion(i, 0, [7], [0.0], [0.0], "stop", 0) for i in range(len(prompts))]
                future.set_result(done)

            threading.Thread(target=answer).start()
            return future

    async def scenario() -> None:
        batcher = GenerationBatcher(Sleeping())  # type: ignore[arg-type]
        batcher.open.set()
        running = asyncio.create_task(batcher.run())
        params = SamplingParams(max_tokens=1)
        results = await asyncio.gather(*(batcher.generate([[1]] * n, params) for n in (1, 3, 2)))
        assert [len(r) for r in results] == [1, 3, 2]
        await asyncio.sleep(0.05)
        assert not batcher.gate.locked(), "the gate is held with nothing running"
        late = asyncio.create_task(batcher.generate([[1]] * 4, params))
        await asyncio.sleep(0.05)
        async with batcher.gate:  # a swap waits for the running call, then holds the engine
            assert late.done()
        assert len(await batcher.generate([[1]], params)) == 1  # and calls go on after it
        running.cancel()

    asyncio.run(scenario())


def test_overlapping_calls_count_once_toward_the_busy_fraction() -> None:
    from libs.rollout.throughput import ThroughputMeter

    meter = ThroughputMeter(window_s=10.0)
    meter.started = 0.0
    for start, end in ((1.0, 3.0), (2.0, 4.0), (2.5, 3.5), (6.0, 7.0)):
        meter.record(start, end, 10)
    assert meter.busy_fraction(now=10.0) == pytest.approx(0.4)  # [1, 4] and [6, 7]


def test_the_meter_keeps_the_union_of_calls_in_its_window_as_calls_come() -> None:
    # The meter is updated at every call (hundreds a second with the paged engine): it keeps
    # the union incrementally; here it must equal the union computed from scratch, with calls
    # overlapping, nested, recorded out of order, and leaving the window as time passes.
    import random

    from libs.rollout.throughput import ThroughputMeter

    rng = random.Random(5)
    meter = ThroughputMeter(window_s=5.0)
    meter.started = 0.0
    calls: list[tuple[float, float, int]] = []
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(20.0)
        start = now - rng.choice([rng.uniform(0, 0.3), rng.uniform(0, 3.0)])
        end = now - (rng.uniform(0, 0.2) if rng.random() < 0.2 else 0.0)  # some end earlier
        tokens = rng.randrange(1, 50)
        start = min(max(start, 0.0), end)
        meter.record(start, end, tokens)
        calls.append((start, end, tokens))
        begin = max(0.0, now - 5.0)
        live = [c for c in calls if c[1] >= begin]
        union, covered = 0.0, begin
        for s, e, _ in sorted(live):
            s = max(s, covered)
            if e > s:
                union += e - s
                covered = e
        length = max(now - begin, 1e-9)
        assert meter.busy_fraction(now) == pytest.approx(min(union / length, 1.0), abs=1e-9)
    # Tokens are counted per call by when it ended; calls recorded late leave in order.
    begin = now - 5.0
    in_order_left = 0
    for _, end, tokens in calls:  # the meter drops from the oldest record while it ended early
        if end < begin and in_order_left == 0:
            continue
        in_order_left += tokens
    assert meter.tokens_per_s(now) == pytest.approx(in_order_left / 5.0)


@CUDA
@pytest.mark.parametrize(("tile", "flash_order"), [(64, False), (128, False), (128, True)])
def test_gpu_kernels_match_the_torch_paths(
    tile: int, flash_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paged_attention, "DECODE_TILE", tile)
    monkeypatch.setattr(paged_attention, "DECODE_FLASH_ORDER", flash_order)
    torch.manual_seed(0)
    block, kv_heads, heads, dim = 16, 2, 14, 64
    k_cache = torch.randn(64 * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(63, device="cuda")[:60].add(1).view(4, 15).int()
    positions = torch.tensor([0, 17, 100, 239], device="cuda")  # 1 to 2 tiles of 128
    q = torch.randn(4, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = AttentionPlan.build(positions, torch.ones_like(positions), tables, block)
    reference = chunk_attention(q.float(), k_cache.float(), v_cache.float(), plan, dim**-0.5)
    for splits in (1, 4, 32):
        out = decode_attention(q, k_cache, v_cache, tables, positions, block, dim**-0.5, splits)
        assert ((out.float() - reference).norm() / reference.norm()) < 1e-2
    logits = torch.randn(8, 151936, device="cuda", dtype=torch.bfloat16) * 4
    temperatures = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 1.0], device="cuda")
    seeds = step_seeds(
        torch.arange(8, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda")
    )
    fused = sample_rows_triton(logits, temperatures, seeds)
    raw = logits.float().log_softmax(-1)
    picked = raw.gather(-1, fused.token_ids[:, None]).squeeze(-1)
    assert torch.allclose(fused.raw_logprobs, picked, atol=1e-4)
    assert fused.token_ids[0] == raw[0].argmax() and fused.token_ids[4] == raw[4].argmax()
    for row in (1, 2, 3, 5):
        dist = (logits[row].float() / temperatures[row]).log_softmax(-1)
        assert float(fused.logprobs[row]) == pytest.approx(
            float(dist[fused.token_ids[row]]), abs=1e-3
        )


@CUDA
@pytest.mark.parametrize("preset", ["tiny", "qwen2-0.5b"])
def test_gpu_greedy_completions_equal_the_hf_engines_in_fp32(preset: str) -> None:
    # fp32 on CUDA: both engines compute the same function up to fp32 rounding, so greedy
    # tokens must match exactly (a logic error would not). Prompts staged in the decode
    # graph and prompts prefilled eagerly, concurrent with decoding rows.
    model = build_policy(PolicyConfig(preset=preset, device="cuda", dtype="float32"))
    torch.backends.cuda.matmul.allow_tf32 = False
    long_prompt = TOKENIZER.encode("a prompt long enough for the eager prefill path. " * 12)
    prompts = [*PROMPTS, long_prompt]
    expected = HFEngine(model, TOKENIZER, 64).generate(prompts, GREEDY, num_samples=3)
    paged = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536, eager_prefill_above=256)
    assert paged.runner.fused is not None and paged.runner._graphs, "the fast path must run"
    assert len(long_prompt) >= paged.eager_prefill_above > max(len(p) for p in PROMPTS)
    crowd: list[list[Completion]] = []
    other = threading.Thread(target=lambda: crowd.append(paged.generate(prompts, GREEDY, 2)))
    other.start()
    got = paged.generate(prompts, GREEDY, num_samples=3)
    other.join()
    assert tokens(got) == tokens(expected)
    assert tokens(crowd[0]) == [t for i, t in enumerate(tokens(expected)) if i % 3 < 2]
    assert paged.timings_s["prefill"] > 0.0, "the long prompt must take the eager path"


@CUDA
def test_gpu_weight_update_between_calls_keeps_the_graphs_valid() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_policy(PolicyConfig(device="cuda", dtype="float32"))
    paged = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536)
    paged.generate(PROMPTS, GREEDY, num_samples=2)
    new_state = build_policy(PolicyConfig(device="cpu", dtype="float32", seed=1)).state_dict()
    assert paged.update_weights(new_state, version=1) < 0.05
    fresh = build_policy(PolicyConfig(device="cuda", dtype="float32", seed=1))
    expected = HFEngine(fresh, TOKENIZER, 64).generate(PROMPTS, GREEDY, num_samples=2)
    assert tokens(paged.generate(PROMPTS, GREEDY, num_samples=2)) == tokens(expected)


@CUDA
@pytest.mark.parametrize(
    ("preset", "dtype", "tolerance"),
    [("tiny", "float32", 1e-4), ("qwen2-0.5b", "float32", 1e-4), ("qwen2-0.5b", "bfloat16", 3e-2)],
)
def test_gpu_fused_layers_match_transformers_modules(
    preset: str, dtype: str, tolerance: float
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_policy(PolicyConfig(preset=preset, device="cuda", dtype=dtype))
    paged = PagedEngine(model, TOKENIZER, 16, kv_cache_tokens=8192, use_cuda_graphs=False)
    chunk = [PrefillChunk(list(range(100, 250)), 0, [paged.pool.allocate() for _ in range(10)])]
    fused = paged.runner.prefill(chunk).float()
    paged.runner.fused = None  # the same chunk through transformers' modules
    plain = paged.runner.prefill(chunk).float()
    # Each fused kernel is bitwise equal to transformers' op on the same input (checked on
    # an H200); the whole bf16 forward still differs by 1.6e-2 relative (measured, cause
    # not found: GEMM algorithms chosen per shape are a candidate).
    assert ((fused - plain).norm() / plain.norm()) < tolerance


def gpu_mismatch_nats() -> float:
    """Mean |sampled logprob - trainer's recomputed logprob| of 4 prompts x 16 samples x 64
    tokens, qwen2-0.5b bf16 on the GPU."""
    model = build_policy(PolicyConfig(preset="qwen2-0.5b", device="cuda"))
    paged = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536)
    prompts = [list(range(10 + p, 74 + p)) for p in range(4)]
    completions = paged.generate(prompts, SamplingParams(max_tokens=64, seed=0), num_samples=16)
    diffs = []
    for c in completions:
        sequence = torch.tensor([prompts[c.prompt_index] + c.token_ids], device="cuda")
        with torch.no_grad():
            trainer = sequence_logprobs(model, sequence, torch.ones_like(sequence))[0]
        start = len(prompts[c.prompt_index]) - 1
        recomputed = trainer[start : start + len(c.token_ids)].float().cpu()
        diffs.append((torch.tensor(c.logprobs) - recomputed).abs())
    return float(torch.cat(diffs).mean())


@CUDA
def test_gpu_sampled_logprobs_match_the_trainer_within_the_hf_engines_mismatch() -> None:
    # Issue 11's bar: 0.0098 nats, the hf engine's when the issue was written. Measured on an
    # NVIDIA H200 with the decode kernel walking key tiles of 128 as the trainer's attention
    # does: 0.00952 on these prompts (0.00983 with tiles of 64; the hf engine 0.00863).
    mean = gpu_mismatch_nats()
    assert mean <= 0.0098, f"mean |sampled - trainer logprob| = {mean:.5f} nats"


def test_a_swap_between_steps_goes_on_under_running_calls(engine: PagedEngine) -> None:
    """The running call is not waited for: it goes on with the new weights, and its
    completions say both versions (the swap's own test: every write waited before)."""
    local = make_paged(seed=0)
    live = local.live_tensors()
    assert live is not None
    new_state = build_policy(PolicyConfig(device="cpu", seed=1)).state_dict()
    # Long enough that the swap lands mid-call on a fast CPU too (150 tokens ended before
    # the swap on a 16-core GPU host).
    params = SamplingParams(temperature=0.0, max_tokens=1000)
    running = local.submit(PROMPTS, params)
    wait_for(lambda: local.num_steps > 2)
    local.write_between_steps(lambda: [live[k].copy_(v) for k, v in new_state.items()], 5)
    assert local.policy_version == 5
    spanned = [c for c in running.result(timeout=120) if c.policy_version_end is not None]
    assert spanned, "no completion was still running at the swap"
    assert all(c.policy_version == 0 and c.policy_version_end == 5 for c in spanned)
    old = {c.prompt_index: c.token_ids for c in engine.generate(PROMPTS, params)}
    # The swap changed what the running rows went on to sample (the new weights' argmax).
    assert any(c.token_ids != old[c.prompt_index] for c in spanned)
    after = local.generate([PROMPTS[2]], GREEDY, num_samples=2)
    assert all(c.policy_version == 5 and c.policy_version_end is None for c in after)
