"""Benchmark the inference engines side by side with the trainer's forward+backward, in one run.

On one GPU (qwen2-0.5b preset, bf16, random init), the old `hf` engine and the new `paged`
engine on the same model and the same shapes, then the trainer's fwd+bwd+AdamW tokens/s, so
inference:training is a ratio measured side by side:

- 64 rows (4 prompts x 16 samples), 64-token prompts, 256 new tokens;
- 256 rows (16 prompts x 16 samples), same lengths;
- 16 samples of one 1,024-token prompt, 128 new tokens;
- 1 row at a 1,400-token context (decode ms per token);
- trainer: forward + backward + AdamW on 32 x 512 tokens;
- weight swap pause (full state, staged on the device, then written in place);
- multi-turn: 64 concurrent simulated tool episodes through the rollout batcher (merging
  batcher + `hf` vs continuous batcher + `paged`), tokens/s and episode latency;
- greedy agreement of the two engines (tokens agreed before the first divergence, and the
  logit gap there) and the sampled logprobs' mismatch to the trainer.

    PYTHONPATH=. python3 bench/engine_bench.py            # bench/results/<card>/engine.json
    .venv/bin/python bench/engine_bench.py --dry-run      # tiny model on CPU, small shapes (CI)

Not part of `make bench` (which runs on CPU): a GPU-only measurement; without CUDA and
without --dry-run it exits with that message. Results of an H200: bench/results/h200/engine.json.

Sampling is temperature 1 (RL rollouts); prompts are random token ids, so rows rarely stop
early and tokens/s counts the tokens actually generated.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.engine.base import InferenceEngine, SamplingParams
from libs.engine.factory import EngineConfig, build_engine
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy, sequence_logprobs


@dataclass(frozen=True)
class Case:
    """One generation shape."""

    name: str
    num_prompts: int
    num_samples: int
    prompt_tokens: int
    new_tokens: int


GPU_CASES = [
    Case("64_rows", 4, 16, 64, 256),
    Case("256_rows", 16, 16, 64, 256),
    Case("16_samples_of_1024_prompt", 1, 16, 1024, 128),
]
DRY_CASES = [Case("16_rows", 4, 4, 16, 16), Case("4_samples_of_128_prompt", 1, 4, 128, 8)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def time_generate(
    engine: InferenceEngine, case: Case, vocab: int, device: torch.device
) -> dict[str, Any]:
    """Tokens/s of one generate call of `case` (after a short warm-up on other prompts)."""
    warm = random_prompts(case.num_prompts, case.prompt_tokens, vocab, seed=1)
    engine.generate(warm, SamplingParams(max_tokens=4, seed=1), case.num_samples)
    prompts = random_prompts(case.num_prompts, case.prompt_tokens, vocab, seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=case.new_tokens, seed=0)
    phases_before = dict(getattr(engine, "timings_s", {}))
    sync(device)
    start = time.perf_counter()
    completions = engine.generate(prompts, params, case.num_samples)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    result: dict[str, Any] = {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
    }
    phases = getattr(engine, "timings_s", {})
    if phases:  # the paged engine's split: device work + wait, Python bookkeeping, prefill
        result["phases_s"] = {k: round(v - phases_before[k], 4) for k, v in phases.items()}
    return result


def time_long_context(
    engine: InferenceEngine, context: int, new_tokens: int, vocab: int, device: torch.device
) -> dict[str, float]:
    """One row at a `context`-token prompt: decode ms per token (from a 1-token and an
    n-token call, so prefill cancels out) and end-to-end tokens/s."""
    prompt = random_prompts(1, context, vocab, seed=3)
    engine.generate(prompt, SamplingParams(max_tokens=2, seed=0))  # warm-up
    seconds: dict[int, float] = {}
    for count in (1, new_tokens):
        sync(device)
        start = time.perf_counter()
        got = engine.generate(prompt, SamplingParams(max_tokens=count, seed=0, temperature=1.0))
        sync(device)
        seconds[count] = time.perf_counter() - start
        assert len(got[0].token_ids) == count or got[0].finish_reason == "stop"
    per_token_ms = (seconds[new_tokens] - seconds[1]) / (new_tokens - 1) * 1000
    return {
        "decode_ms_per_token": round(per_token_ms, 3),
        "decode_tokens_per_s": round(1000 / per_token_ms, 1),
        "end_to_end_tokens_per_s": round(new_tokens / seconds[new_tokens], 1),
    }


def time_trainer(config: PolicyConfig, rows: int, length: int, steps: int) -> dict[str, float]:
    """Forward + backward + AdamW tokens/s of the policy on [rows, length] tokens."""
    model = build_policy(config.model_copy(update={"seed": 7})).train()
    device = model.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (rows, length), device=device)
    mask = torch.ones_like(ids)

    def step() -> None:
        loss = -sequence_logprobs(model, ids, mask).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": round(rows * length * steps / seconds, 1),
        "step_s": round(seconds / steps, 4),
        "rows": rows,
        "length": length,
    }


def swap_pause(engine: InferenceEngine, other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Pauses of a full-state `update_weights` (CPU shadow, as the follower's GPU path) and
    of a `write_in_place` copy from device tensors, in ms (median of 5)."""
    live = engine.live_tensors()
    assert live is not None
    cpu_state = {name: tensor.cpu() for name, tensor in other.items()}
    update_ms, in_place_ms = [], []
    for version in range(1, 6):
        update_ms.append(engine.update_weights(cpu_state, version * 2) * 1000)
        _, pause = engine.write_in_place(
            lambda: [live[name].copy_(tensor) for name, tensor in other.items()], version * 2 + 1
        )
        in_place_ms.append(pause * 1000)
    return {
        "update_weights_ms": round(statistics.median(update_ms), 2),
        "write_in_place_ms": round(statistics.median(in_place_ms), 2),
    }


def greedy_agreement(
    old: InferenceEngine, new: InferenceEngine, model: Any, vocab: int, tokens: int
) -> dict[str, Any]:
    """Greedy completions of 16 prompts by both engines: rows identical, tokens agreed
    before each row's first divergence, and there the gap between the two engines' tokens'
    logits as the trainer's forward computes them over the common prefix (a gap within the
    dtype's rounding of the logits says the engines split a near-tie, not a logic error)."""
    prompts = random_prompts(16, 64, vocab, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    a = old.generate(prompts, params)
    b = new.generate(prompts, params)
    agreed: list[int] = []
    gaps: list[float] = []
    for prompt, x, y in zip(prompts, a, b, strict=True):
        same = 0
        while same < min(len(x.token_ids), len(y.token_ids)) and (
            x.token_ids[same] == y.token_ids[same]
        ):
            same += 1
        agreed.append(same)
        if same < min(len(x.token_ids), len(y.token_ids)):
            ids = torch.tensor([prompt + x.token_ids[:same]], device=model.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].float()
            gaps.append(abs(float(logits[x.token_ids[same]] - logits[y.token_ids[same]])))
    return {
        "rows_identical_fraction": sum(n == tokens for n in agreed) / len(agreed),
        "tokens_per_row": tokens,
        "tokens_agreed_before_first_divergence": agreed,
        "divergence_logit_gaps": [round(gap, 5) for gap in gaps],
    }


def logprob_mismatch(engine: InferenceEngine, model: Any, vocab: int, new_tokens: int) -> float:
    """Mean |sampled logprob - trainer's recomputed logprob| over 64 sampled rows (nats)."""
    prompts = random_prompts(4, 64, vocab, seed=5)
    completions = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, seed=0), 16)
    diffs = []
    with torch.no_grad():
        for c in completions:
            sequence = torch.tensor([prompts[c.prompt_index] + c.token_ids], device=model.device)
            trainer = sequence_logprobs(model, sequence, torch.ones_like(sequence))[0]
            start = len(prompts[c.prompt_index]) - 1
            recomputed = trainer[start : start + len(c.token_ids)].float().cpu()
            diffs.append((torch.tensor(c.logprobs) - recomputed).abs())
    return round(float(torch.cat(diffs).mean()), 5)


def multi_turn(
    engine: InferenceEngine, episodes: int, turns: int, vocab: int, max_new: int
) -> dict[str, Any]:
    """Concurrent simulated tool episodes through the rollout batcher: per turn the policy
    writes up to a seeded number of tokens, then a 32-token tool result joins the context."""
    try:
        from libs.rollout.batcher import GenerationBatcher
    except ImportError as exc:  # the bus stack is not installed on this machine
        return {"skipped": f"libs.rollout.batcher not importable: {exc}"}

    async def episode(batcher: GenerationBatcher, index: int) -> tuple[int, float]:
        rng = random.Random(index)
        context = random_prompts(1, 200, vocab, seed=100 + index)[0]
        generated, start = 0, time.perf_counter()
        for _ in range(turns):
            limit = rng.randrange(max_new // 4, max_new + 1)
            # No seed: the merging batcher merges only requests that differ in max_tokens alone.
            params = SamplingParams(temperature=1.0, max_tokens=limit)
            completion = (await batcher.generate([context], params))[0]
            generated += len(completion.token_ids)
            context = context + completion.token_ids + [rng.randrange(10, 200) for _ in range(32)]
        return generated, time.perf_counter() - start

    async def run_all() -> tuple[list[tuple[int, float]], float]:
        batcher = GenerationBatcher(engine, max_batch_rows=max(64, episodes))
        batcher.open.set()
        loop_task = asyncio.create_task(batcher.run())
        start = time.perf_counter()
        results = await asyncio.gather(*(episode(batcher, i) for i in range(episodes)))
        wall = time.perf_counter() - start
        loop_task.cancel()
        return list(results), wall

    phases_before = dict(getattr(engine, "timings_s", {}))
    steps_before = getattr(engine, "num_steps", 0)
    results, wall = asyncio.run(run_all())
    latencies = sorted(seconds for _, seconds in results)
    tokens = sum(count for count, _ in results)
    phases = getattr(engine, "timings_s", {})
    extra: dict[str, Any] = {}
    if phases:
        extra["phases_s"] = {k: round(v - phases_before[k], 4) for k, v in phases.items()}
        extra["steps"] = getattr(engine, "num_steps", 0) - steps_before
    return {
        **extra,
        "episodes": episodes,
        "turns": turns,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "episode_latency_median_s": round(statistics.median(latencies), 3),
        "episode_latency_max_s": round(latencies[-1], 3),
    }


def measure(name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    print(f"{name}: {result}  ({time.perf_counter() - start:.1f}s)", flush=True)
    return result


@dataclass
class Bench:
    """The model and both engines over it, on one device."""

    config: PolicyConfig
    model: Any
    hf: HFEngine
    paged: PagedEngine
    cuda: bool

    @property
    def vocab(self) -> int:
        return int(self.model.config.vocab_size)


def setup(dry_run: bool) -> tuple[Bench, dict[str, Any]]:
    """Both engines on qwen2-0.5b (GPU) or the tiny preset (CPU dry run), and the header."""
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        raise SystemExit("no CUDA device: run with --dry-run for the CPU check")
    config = PolicyConfig(preset="qwen2-0.5b" if cuda else "tiny", device="cuda" if cuda else "cpu")
    model = build_policy(config)  # both engines run this one model (byte tokenizer)
    hf = build_engine(EngineConfig(type="hf", max_batch_rows=256), config, model)
    start = time.perf_counter()
    paged = build_engine(EngineConfig(type="paged", max_batch_rows=256), config, model)
    assert isinstance(hf, HFEngine) and isinstance(paged, PagedEngine)
    header = {
        "card": torch.cuda.get_device_name(model.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "preset": config.preset,
        "dtype": str(next(model.parameters()).dtype),
        "paged_engine_setup_s": round(time.perf_counter() - start, 2),
        "paged_kv_cache_tokens": paged.pool.capacity * paged.pool.block_size,
    }
    return Bench(config, model, hf, paged, cuda), header


def engine_figures(bench: Bench) -> dict[str, Any]:
    """The generation shapes, long context, greedy agreement and mismatch, old vs new."""
    hf, paged, vocab, device = bench.hf, bench.paged, bench.vocab, bench.model.device
    cases: dict[str, Any] = {}
    for case in GPU_CASES if bench.cuda else DRY_CASES:
        old = measure(f"hf {case.name}", functools.partial(time_generate, hf, case, vocab, device))
        new = measure(
            f"paged {case.name}", functools.partial(time_generate, paged, case, vocab, device)
        )
        speedup = round(new["tokens_per_s"] / old["tokens_per_s"], 2)
        cases[case.name] = {"shape": asdict(case), "hf": old, "paged": new, "speedup": speedup}
    context, new_tokens = (1400, 64) if bench.cuda else (128, 8)
    long = {
        name: measure(
            f"{name} long",
            functools.partial(time_long_context, engine, context, new_tokens, vocab, device),
        )
        for name, engine in (("hf", hf), ("paged", paged))
    }
    return {
        "cases": cases,
        "long_context_1_row": {"context_tokens": context, **long},
        "greedy": measure(
            "greedy agreement",
            lambda: greedy_agreement(hf, paged, bench.model, vocab, 32 if bench.cuda else 8),
        ),
        "logprob_mean_abs_diff_vs_trainer": {
            "hf": measure("mismatch hf", lambda: logprob_mismatch(hf, bench.model, vocab, 64)),
            "paged": measure(
                "mismatch paged", lambda: logprob_mismatch(paged, bench.model, vocab, 64)
            ),
        },
    }


def loop_figures(bench: Bench) -> dict[str, Any]:
    """Trainer fwd+bwd+AdamW, multi-turn episodes and the weight swap pause."""
    rows, length, steps = (32, 512, 5) if bench.cuda else (4, 64, 2)
    episodes, turns, max_new = (64, 4, 128) if bench.cuda else (8, 2, 8)
    other = build_policy(bench.config.model_copy(update={"seed": 11})).state_dict()
    engines = (("hf", bench.hf), ("paged", bench.paged))
    return {
        "trainer_fwd_bwd_adamw": measure(
            "trainer", lambda: time_trainer(bench.config, rows, length, steps)
        ),
        "multi_turn": {
            name: measure(
                f"multi-turn {name}",
                functools.partial(multi_turn, engine, episodes, turns, bench.vocab, max_new),
            )
            for name, engine in engines
        },
        "swap_pause": {
            name: measure(f"swap {name}", functools.partial(swap_pause, engine, other))
            for name, engine in engines
        },
    }


def run(dry_run: bool, out: Path | None) -> dict[str, Any]:
    """Measure everything in one process, write the JSON report, return it."""
    bench, report = setup(dry_run)
    report.update(engine_figures(bench))
    report.update(loop_figures(bench))
    train_tps = report["trainer_fwd_bwd_adamw"]["tokens_per_s"]
    report["inference_gpus_per_training_gpu"] = {
        name: {
            engine: round(train_tps / result[engine]["tokens_per_s"], 3)
            for engine in ("hf", "paged")
        }
        for name, result in report["cases"].items()
    }
    target = out or result_file("engine", str(report["card"]) if bench.cuda else None)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(result_json(report))
    print(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args()
    run(args.dry_run, args.out)


if __name__ == "__main__":
    main()
