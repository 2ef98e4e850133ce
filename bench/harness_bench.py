"""Episodes through the real rollout harness, old engine (`hf`) vs new (`paged`), in one run.

The path a rollout-worker takes, minus the bus: `AgentRunner` (chat template, tool-call
parser, turn loop), the environments served in process (`LocalEnvClient`: env-gateway's
request handling, called directly), the `GenerationBatcher` in front of the engine (merging
calls for `hf`, handing each request over as it comes for `paged`). Both engines run one
model (byte-0.5b, bf16 on the GPU: what bench/gpu_loop.sh trains; the tiny preset on CPU).

Scenarios:
- `arith_loop`: the GPU loop's request pattern. Arith tasks (2-3 token answers), groups of
  16, 8 tasks at a time (the worker's max_batch_tasks), a closed loop over N tasks: one
  engine request per sample, each arriving when its episode resets. Samples/s is what
  bounds the loop's rollout side.
- `calc_multi_turn`: 64 concurrent `calc` episodes (8 tasks x 8 samples), up to 4 assistant
  turns each. A random-init model writes no tool calls, so the tail of each of an episode's
  first 3 turns is replaced by a well-formed calc call (`ScriptedToolCalls`) after the engine
  generated the turn; the harness then parses it, the env answers it, and the next turn's
  context holds the whole transcript (the paged engine reuses its earlier turns' KV up to the
  replaced tail). Tokens/s counts only tokens the engine generated.

    PYTHONPATH=. python3 bench/harness_bench.py               # GPU: bench/results/<card>/
    .venv/bin/python bench/harness_bench.py --dry-run         # tiny model on CPU (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from result_file import result_file, result_json

from libs.chat.tool_calls import CALL_OPEN
from libs.domains.registry import make_env
from libs.engine.base import Completion, InferenceEngine, SamplingParams
from libs.engine.factory import EngineConfig, build_engine
from libs.envs.local_client import LocalEnvClient
from libs.policy import PolicyConfig, build_policy
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import GenerateFn, RunnerSettings
from libs.tokenizer import ByteTokenizer, Tokenizer
from proto import messages as m
from proto.messages import Rollout

TOKENIZER = ByteTokenizer()
TOOL_RESULT_OPEN = "<tool_result id="


@dataclass(frozen=True)
class Scenario:
    """Episodes of one environment: `tasks` tasks of `group` samples, `concurrent` tasks at
    a time (a closed loop), at most `turns` assistant turns an episode."""

    name: str
    env: str
    difficulty: int
    tasks: int
    group: int
    concurrent: int
    turns: int


class ScriptedToolCalls:
    """A generate function: the engine's completion, whose tail becomes a calc tool call
    on each of an episode's first `calls` turns (a random-init model writes none)."""

    def __init__(self, generate: GenerateFn, tokenizer: Tokenizer, calls: int) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.calls = calls
        self.generated_tokens = 0

    async def __call__(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        completions = await self.generate(prompts, params)
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        return [self._scripted(p, c) for p, c in zip(prompts, completions, strict=True)]

    def _scripted(self, prompt: list[int], completion: Completion) -> Completion:
        done = self.tokenizer.decode(prompt).count(TOOL_RESULT_OPEN)
        if done >= self.calls:
            return completion
        text = f'{CALL_OPEN}{{"name": "add", "arguments": {{"a": {done}, "b": 2}}}}</tool_call>'
        call = self.tokenizer.encode(text)
        keep = max(len(completion.token_ids) - len(call), 0)
        ids = completion.token_ids[:keep] + call
        logprobs = (completion.logprobs[:keep] + [0.0] * len(call))[: len(ids)]
        raw = (completion.raw_logprobs[:keep] + [0.0] * len(call))[: len(ids)]
        return replace(completion, token_ids=ids, logprobs=logprobs, raw_logprobs=raw)


def scenarios(dry_run: bool) -> list[Scenario]:
    if dry_run:
        return [
            Scenario("arith_loop", "arith", 1, tasks=4, group=4, concurrent=2, turns=1),
            Scenario("calc_multi_turn", "calc", 2, tasks=1, group=2, concurrent=1, turns=2),
        ]
    return [
        Scenario("arith_loop", "arith", 1, tasks=64, group=16, concurrent=8, turns=1),
        Scenario("calc_multi_turn", "calc", 2, tasks=8, group=8, concurrent=8, turns=4),
    ]


async def run_scenario(engine: InferenceEngine, scenario: Scenario) -> dict[str, Any]:
    """Run `scenario` on `engine` through the harness; its figures."""
    batcher = GenerationBatcher(engine, max_batch_rows=1024, batch_window_s=0.005)
    batcher.open.set()
    serving = asyncio.create_task(batcher.run())
    generate: GenerateFn = batcher.generate
    scripted = None
    if scenario.turns > 1:
        scripted = ScriptedToolCalls(batcher.generate, TOKENIZER, scenario.turns - 1)
        generate = scripted
    env = make_env(scenario.env)
    client = LocalEnvClient({scenario.env: env})
    runner = AgentRunner(
        client,
        TOKENIZER,
        generate,
        RunnerSettings(worker_id="bench", temperature=1.0),
        AgentSettings(max_turns=scenario.turns, context_budget_tokens=8192, summarize=False),
    )
    source = env.task_source(difficulty=scenario.difficulty, group_size=scenario.group, seed=0)
    next_task = iter(range(scenario.tasks))
    rollouts: list[tuple[float, Rollout]] = []

    async def worker() -> None:
        for index in next_task:
            task = source.task(index)
            started = time.time()
            rollouts.extend((started, r) for r in await runner.run(task))

    steps_before = getattr(engine, "num_steps", 0)
    phases_before = dict(getattr(engine, "timings_s", {}))
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(scenario.concurrent)))
    wall = time.perf_counter() - start
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    latencies = sorted(r.created_at - started for started, r in rollouts)
    turn_tokens = sum(r.stats.get(m.EPISODE_STAT_GENERATED_TOKENS, 0.0) for _, r in rollouts)
    tokens = scripted.generated_tokens if scripted else int(turn_tokens)
    figures: dict[str, Any] = {
        "episodes": len(rollouts),
        "wall_s": round(wall, 3),
        "episodes_per_s": round(len(rollouts) / wall, 1),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "turns_mean": round(statistics.mean(r.stats[m.EPISODE_STAT_TURNS] for _, r in rollouts), 2),
        "episode_latency_median_s": round(statistics.median(latencies), 3),
        "episode_latency_p90_s": round(latencies[math.ceil(0.9 * len(latencies)) - 1], 3),
        "episode_latency_max_s": round(latencies[-1], 3),
        "finish_reasons": sorted({r.finish_reason for _, r in rollouts}),
        "engine_calls": batcher.num_calls,
    }
    if phases_before:
        phases = getattr(engine, "timings_s", {})
        figures["engine_steps"] = getattr(engine, "num_steps", 0) - steps_before
        figures["phases_s"] = {k: round(v - phases_before[k], 4) for k, v in phases.items()}
    return figures


def run(dry_run: bool, out: Path | None, engines: list[str]) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        raise SystemExit("no CUDA device: run with --dry-run for the CPU check")
    policy = PolicyConfig(
        preset="byte-0.5b" if cuda else "tiny", device="cuda" if cuda else "cpu", seed=0
    )
    model = build_policy(policy)
    built = {
        name: build_engine(EngineConfig(type=name, max_batch_rows=256), policy, model)
        for name in engines
    }
    report: dict[str, Any] = {
        "card": torch.cuda.get_device_name(model.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "preset": policy.preset,
        "dtype": str(next(model.parameters()).dtype),
        "max_batch_rows": 256,
    }
    for scenario in scenarios(dry_run):
        results: dict[str, Any] = {"scenario": scenario.__dict__}
        for name, engine in built.items():
            warm = replace(scenario, tasks=1, concurrent=1, group=2, turns=1)
            asyncio.run(run_scenario(engine, warm))  # compile kernels, pick GEMMs
            results[name] = asyncio.run(run_scenario(engine, scenario))
            print(f"{scenario.name} {name}: {results[name]}", flush=True)
        if "hf" in results and "paged" in results:
            for key in ("tokens_per_s", "episodes_per_s"):
                results[f"speedup_{key}"] = round(
                    results["paged"][key] / max(results["hf"][key], 1e-9), 2
                )
        report[scenario.name] = results
    target = out or result_file("harness", str(report["card"]) if cuda else None)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(result_json(report))
    print(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    parser.add_argument("--engines", default="hf,paged", help="comma-separated engine types")
    args = parser.parse_args()
    run(args.dry_run, args.out, args.engines.split(","))


if __name__ == "__main__":
    main()
