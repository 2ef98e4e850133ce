"""Where the sampled logprobs' mismatch to the trainer comes from: the engines side by side.

Issue 11's bar is the mean |sampled logprob - trainer's recomputed logprob| of the `hf`
engine (0.0098 nats on the GPU). `tests/test_engine_paged.py` measures the `paged` engine on
one seed of 4 prompts x 16 samples x 64 tokens (qwen2-0.5b, bf16). One seed is one draw: this
measures each engine variant over several seeds and prompt sets on the same model, so a
difference can be told from the spread of the measure itself:

- `hf`: the old engine (transformers' modules, a dynamic KV cache);
- `paged`: the new engine as it runs (fused layer kernels, CUDA graphs);
- `paged_eager`: the same kernels without CUDA graphs (must equal `paged`);
- `paged_tile128`, `paged_flash_order`: the decode kernel with key tiles of 128, and with
  FlashAttention-2's walk over them as well (`DECODE_TILE`, `DECODE_FLASH_ORDER` in
  libs/engine/paged_attention.py; `paged` runs their defaults);
- `paged_modules`: transformers' modules for norms, projections and RoPE, the paged decode
  attention kernel (which part of the gap is the fused kernels', which the attention's);
- `trainer_eager`: the trainer's own forward with eager attention against its SDPA forward,
  on `paged`'s samples (how far two exact-in-fp32 implementations of the trainer differ).

    PYTHONPATH=. python3 bench/engine_mismatch.py [--seeds 4] [--out FILE]

GPU only. Prints a table and writes JSON (default bench/results/<card>/engine_mismatch.json).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.engine import paged_attention
from libs.engine.base import InferenceEngine, SamplingParams
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def prompts_for(seed: int) -> list[list[int]]:
    """4 prompts of 64 token ids; seed 0 gives the test's prompts."""
    return [list(range(10 + p + 64 * seed, 74 + p + 64 * seed)) for p in range(4)]


def samples(engine: InferenceEngine, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, tokens, sampled logprobs) of 16 samples x 64 tokens of each prompt."""
    prompts = prompts_for(seed)
    completions = engine.generate(prompts, SamplingParams(max_tokens=64, seed=seed), 16)
    return [(prompts[c.prompt_index], c.token_ids, list(c.logprobs)) for c in completions]


def mismatch(model: Any, drawn: list[tuple[list[int], list[int], list[float]]]) -> float:
    """Mean |sampled - recomputed| over every sampled token."""
    diffs = []
    for prompt, tokens, logprobs in drawn:
        sequence = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            trainer = sequence_logprobs(model, sequence, torch.ones_like(sequence))[0]
        start = len(prompt) - 1
        recomputed = trainer[start : start + len(tokens)].float().cpu()
        diffs.append((torch.tensor(logprobs) - recomputed).abs())
    return float(torch.cat(diffs).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    card = torch.cuda.get_device_name()
    model = build_policy(PolicyConfig(preset="qwen2-0.5b", device="cuda"))
    print(f"trainer attention: {model.config._attn_implementation}", flush=True)
    paged = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536)
    paged_eager = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536, use_cuda_graphs=False)
    paged_modules = PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536, use_cuda_graphs=False)
    paged_modules.runner.fused = None
    engines: dict[str, InferenceEngine] = {
        "hf": HFEngine(model, TOKENIZER, 64),
        "paged": paged,
        "paged_eager": paged_eager,
        "paged_modules": paged_modules,
        "paged_tile128": _with_decode_kernel(model, tile=128, flash_order=False),
        "paged_flash_order": _with_decode_kernel(model, tile=128, flash_order=True),
    }
    rows: dict[str, list[float]] = {name: [] for name in [*engines, "trainer_eager"]}
    for seed in range(args.seeds):
        for name, engine in engines.items():
            drawn = samples(engine, seed)
            rows[name].append(mismatch(model, drawn))
            if name == "paged":
                recomputed_eager = _eager_vs_sdpa(model, drawn)
                rows["trainer_eager"].append(recomputed_eager)
        print(f"seed {seed}: " + ", ".join(f"{n} {v[-1]:.5f}" for n, v in rows.items()), flush=True)
    summary = {
        name: {
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
            "per_seed": values,
        }
        for name, values in rows.items()
    }
    print(f"\n{card}, qwen2-0.5b bf16, {args.seeds} seeds x 4 prompts x 16 samples x 64 tokens")
    print(f"{'variant':<16}{'mean':>10}{'min':>10}{'max':>10}")
    for name, figures in summary.items():
        print(f"{name:<16}{figures['mean']:>10.5f}{figures['min']:>10.5f}{figures['max']:>10.5f}")
    out = args.out or result_file("engine_mismatch", card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json({"card": card, "seeds": args.seeds, "variants": summary}))


def _with_decode_kernel(model: Any, *, tile: int, flash_order: bool) -> PagedEngine:
    """A paged engine whose captured decode graphs run the kernel with these settings."""
    defaults = paged_attention.DECODE_TILE, paged_attention.DECODE_FLASH_ORDER
    paged_attention.DECODE_TILE, paged_attention.DECODE_FLASH_ORDER = tile, flash_order
    try:
        return PagedEngine(model, TOKENIZER, 64, kv_cache_tokens=65536)
    finally:
        paged_attention.DECODE_TILE, paged_attention.DECODE_FLASH_ORDER = defaults


def _eager_vs_sdpa(model: Any, drawn: list[tuple[list[int], list[int], list[float]]]) -> float:
    """Mean |the trainer's recomputation - the same with eager attention| over the same
    tokens."""
    diffs = []
    for prompt, tokens, _ in drawn:
        sequence = torch.tensor([prompt + tokens], device="cuda")
        start = len(prompt) - 1
        got = []
        default = model.config._attn_implementation
        for implementation in (default, "eager"):
            model.config._attn_implementation = implementation
            with torch.no_grad():
                scored = sequence_logprobs(model, sequence, torch.ones_like(sequence))[0]
            got.append(scored[start : start + len(tokens)].float().cpu())
        model.config._attn_implementation = default
        diffs.append((got[0] - got[1]).abs())
    return float(torch.cat(diffs).mean())


if __name__ == "__main__":
    main()
