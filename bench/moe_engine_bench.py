"""What recording the routing costs the `paged` engine on a mixture-of-experts model.

On one GPU: the moe-1b preset (Qwen3-MoE layers, 48 experts, top-8, 16 layers; bf16, random
init) in paged engines over the same model, one recording the experts each token was
routed to (the default) and two not (`record_routing=False`), taking turns on the same
shapes; tokens/s of each (median of the rounds), the cost of recording in percent (issue
#34's bar: at most 5%), how far the two engines that do not record differ (the
measurement's noise), and the routing bytes per token a completion carries.

- 64 rows (4 prompts x 16 samples), 64-token prompts, 256 new tokens;
- 256 rows (16 prompts x 16 samples), same lengths.

    PYTHONPATH=. python3 bench/moe_engine_bench.py          # bench/results/<card>/moe_engine.json
    .venv/bin/python bench/moe_engine_bench.py --dry-run    # tiny-moe on CPU, small shapes

Not part of `make bench` (a GPU measurement); without CUDA and without --dry-run it exits
with that message. Sampling is temperature 1 with a seed per round, prompts random token ids.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.engine.base import SamplingParams
from libs.engine.moe_layers import moe_spec
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy
from libs.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class Case:
    """One generation shape."""

    name: str
    num_prompts: int
    num_samples: int
    prompt_tokens: int
    new_tokens: int


GPU_CASES = [Case("64_rows", 4, 16, 64, 256), Case("256_rows", 16, 16, 64, 256)]
DRY_CASES = [Case("16_rows", 4, 4, 16, 16)]
# Rounds per case. Tokens/s moved 10% from round to round on the H200 (3 rounds at 256 rows:
# 46.2K, 41.5K, 42.8K without recording), as much as the cost measured; so the engines take
# turns on identical work (same prompts and seeds: recording does not change the tokens),
# the order rotating, and the cost is the median of the rounds' paired costs; a third engine
# that does not record either is paired with the second the same way, which shows how far
# two identical engines differ in this measurement.
ROUNDS = 9


def random_prompts(case: Case, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(10, vocab - 10) for _ in range(case.prompt_tokens)]
        for _ in range(case.num_prompts)
    ]


def time_call(engine: PagedEngine, case: Case, vocab: int, seed: int) -> dict[str, float]:
    """One call of `case`: seconds, tokens generated, routing bytes per fed token."""
    prompts = random_prompts(case, vocab, seed)
    params = SamplingParams(max_tokens=case.new_tokens, seed=seed)
    start_s = time.perf_counter()
    completions = engine.generate(prompts, params, case.num_samples)
    seconds = time.perf_counter() - start_s
    tokens = sum(len(c.token_ids) for c in completions)
    routed = [c.routed_experts for c in completions if c.routed_experts is not None]
    fed = sum(int(r.shape[0]) for r in routed)
    return {
        "s": seconds,
        "tokens": tokens,
        "routing_bytes_per_fed_token": sum(r.nbytes for r in routed) / fed if fed else 0.0,
    }


def measure_case(engines: dict[str, PagedEngine], case: Case, vocab: int) -> dict[str, Any]:
    """The engines taking turns for ROUNDS rounds on the same prompts and seeds, the order
    rotating each round."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up: kernels, the allocator's pools
        time_call(engine, case, vocab, seed=ROUNDS)
    names = list(engines)
    for round_index in range(ROUNDS):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(time_call(engines[name], case, vocab, seed=round_index))
    result: dict[str, Any] = {"shape": asdict(case)}
    for name, calls in runs.items():
        rates = [call["tokens"] / call["s"] for call in calls]
        result[name] = {
            "tokens_per_s": round(statistics.median(rates), 1),
            "tokens_per_s_rounds": [round(rate, 1) for rate in rates],
            "routing_bytes_per_fed_token": calls[-1]["routing_bytes_per_fed_token"],
        }
    for key, (slow, fast) in {
        "recording_cost_pct": ("record_on", "record_off"),
        # Two engines that both do not record, measured alike: the bench's own noise floor.
        "same_engines_pct": ("record_off_again", "record_off"),
    }.items():
        paired = [  # same tokens: 1 - slow's tokens/s over fast's
            100.0 * (1.0 - fast_call["s"] / slow_call["s"])
            for slow_call, fast_call in zip(runs[slow], runs[fast], strict=True)
        ]
        result[f"{key}_rounds"] = [round(cost, 2) for cost in paired]
        result[key] = round(statistics.median(paired), 2)
    return result


def run(dry_run: bool, out: Path | None) -> dict[str, Any]:
    """Measure, write the JSON report, return it."""
    cuda = torch.cuda.is_available() and not dry_run
    config = PolicyConfig(preset="moe-1b", device="cuda") if cuda else None
    config = config or PolicyConfig(preset="tiny-moe", device="cpu")
    model = build_policy(config)
    tokenizer = ByteTokenizer()
    cases = GPU_CASES if cuda else DRY_CASES
    # On a GPU both engines get the same cache (the second would see less free memory).
    longest = max(c.num_prompts * c.num_samples * (c.prompt_tokens + c.new_tokens) for c in cases)
    kv_tokens = longest if cuda else None
    rows = max(c.num_prompts * c.num_samples for c in cases)
    engines = {
        name: PagedEngine(model, tokenizer, rows, kv_cache_tokens=kv_tokens, record_routing=record)
        for name, record in (
            ("record_on", True),
            ("record_off", False),
            ("record_off_again", False),
        )
    }
    spec, runner = moe_spec(model), engines["record_on"].runner
    assert spec is not None
    card = torch.cuda.get_device_name(model.device) if cuda else f"cpu ({platform.machine()})"
    report: dict[str, Any] = {
        "card": card,
        "preset": config.preset,
        "dtype": str(next(model.parameters()).dtype),
        "cuda_graphs": runner.uses_cuda_graphs,
        "grouped_gemm": runner.moe is not None and runner.moe.grouped,
        "routing_bytes_per_token": spec.shape.bytes_per_token,
        "cases": {case.name: measure_case(engines, case, tokenizer.vocab_size) for case in cases},
    }
    target = out or result_file("moe_engine", card if cuda else None)
    target.write_text(result_json(report))
    print(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny-moe on CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("moe_engine_bench measures a GPU: run it on one, or pass --dry-run")
    run(args.dry_run, args.out)


if __name__ == "__main__":
    main()
