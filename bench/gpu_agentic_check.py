"""The agentic paths on a GPU: the multi-turn harness, serve mode and a served judge, with a
~0.5B bf16 model (preset byte-0.5b, random init) on CUDA.

- harness: a group of `calc` episodes through a real env server on a real nats-server, the
  engine on the GPU behind the generation batcher; checks that every assistant turn's ids
  and logprobs are the engine's and that the trainer's recomputed logprobs on the same
  weights match them (train/inference mismatch on the GPU, multi-turn);
- serve mode: /v1/chat/completions over real HTTP on the same engine (logprobs, token ids,
  guided choice), its returned logprobs compared with the engine's own scoring;
- judge: a judge criterion scored through that server (guided-choice verdicts).

    python bench/gpu_agentic_check.py [--out results.json]

Needs the project importable and a CUDA device (runs on CPU too, slowly, for a dry run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from result_file import result_file

from libs.bus.connection import connect_bus
from libs.bus.provision import provision
from libs.chat.template import chat_template_for
from libs.domains.registry import make_env
from libs.engine.factory import EngineConfig, build_engine
from libs.engine.hf import HFEngine
from libs.envs.client import EnvClient
from libs.envs.server import EnvServer, ServerLimits
from libs.nats_server import NatsServer
from libs.policy import PolicyConfig, sequence_logprobs
from libs.reward.criteria import exact_match
from libs.reward.judge import JudgeConfig, JudgeCriterionConfig, JudgedCriteria, build_judge
from libs.reward.rubric import Criterion, Rubric, score_rollout
from libs.rl import build_batch
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import RunnerSettings
from libs.serve.app import OpenAIApi, ServeConfig, create_app
from libs.serve.generation import ServedPolicy
from libs.serve.server import ServeServer
from libs.tokenizer import ByteTokenizer
from proto.messages import ScoredRollout

TOKENIZER = ByteTokenizer()


async def harness(engine: HFEngine, batcher: GenerationBatcher, url: str, group: int) -> dict:
    bus = await connect_bus(url, name="gpu-agentic")
    await provision(bus.js)
    server = EnvServer(bus.nc, {"calc": make_env("calc")}, ServerLimits(step_timeout_s=60))
    await server.start()
    try:
        runner = AgentRunner(
            EnvClient(bus.nc), TOKENIZER, batcher.generate,
            RunnerSettings(worker_id="gpu", temperature=1.0),
            AgentSettings(max_turns=4, context_budget_tokens=4096),
        )  # fmt: skip
        task = make_env("calc").task_source(difficulty=1, group_size=group, seed=0).task(0)
        started = time.perf_counter()
        rollouts = await runner.run(task)
        elapsed = time.perf_counter() - started
    finally:
        await server.stop()
        await bus.close()
    scored = [ScoredRollout(rollout=r, reward=0.0) for r in rollouts]
    batch = build_batch(scored, [0.0] * len(scored), pad_id=TOKENIZER.pad_id)
    device = next(engine.model.parameters()).device
    batch = batch.to(device)
    with torch.no_grad():
        trainer = sequence_logprobs(engine.model, batch.input_ids, batch.attention_mask)
    mask = batch.loss_mask
    diff = (trainer[mask].float() - batch.behavior_logprobs[mask].float()).abs()
    tokens = int(mask.sum())
    return {
        "episodes": len(rollouts),
        "finish_reasons": [r.finish_reason for r in rollouts],
        "assistant_tokens": tokens,
        "context_tokens_max": int(batch.attention_mask.sum(dim=1).max()),
        "wall_s": round(elapsed, 2),
        "generated_tokens_per_s": round(tokens / elapsed, 1),
        "mismatch_mean_abs_nats": float(diff.mean()),
        "mismatch_max_abs_nats": float(diff.max()),
    }


async def serve_and_judge(engine: HFEngine, batcher: GenerationBatcher) -> dict[str, Any]:
    served = ServedPolicy(batcher.generate, TOKENIZER, score=batcher.score)
    config = ServeConfig(model_name="rlpipe-policy")
    api = OpenAIApi(served, chat_template_for(TOKENIZER), lambda: engine.policy_version, config)
    server = ServeServer(create_app(api), "127.0.0.1", 0, graceful_s=2)
    await server.start()
    base = f"http://127.0.0.1:{server.port}/v1"
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "model": "rlpipe-policy",
                "messages": [{"role": "user", "content": "What is 2 + 3?"}],
                "max_tokens": 64, "temperature": 1.0, "logprobs": True,
                "return_token_ids": True,
            }  # fmt: skip
            latencies = []
            for _ in range(5):
                started = time.perf_counter()
                response = await client.post(f"{base}/chat/completions", json=body)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()
            data = response.json()
            choice = data["choices"][0]
            returned = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            scores = engine.score([data["prompt_token_ids"]], [choice["token_ids"]]).logprobs[0]
            out["chat_latency_median_s"] = round(statistics.median(latencies), 3)
            out["chat_tokens"] = len(choice["token_ids"])
            out["served_vs_rescored_max_abs"] = max(
                abs(a - b) for a, b in zip(returned, scores, strict=True)
            )
            guided = dict(body, guided_choice=["PASS", "FAIL"], temperature=0.0, max_tokens=8)
            response = await client.post(f"{base}/chat/completions", json=guided)
            response.raise_for_status()
            out["guided_choice"] = response.json()["choices"][0]["message"]["content"]
        judge = build_judge(
            JudgeConfig(url=base, model="rlpipe-policy", api_key="",
                        verdict_mode="guided_choice", max_tokens=32, backoff_s=0.01)
        )  # fmt: skip
        criteria = [
            JudgeCriterionConfig(name="correct", weight=1.0, description="The answer is right.")
        ]
        rubric = Rubric(
            [Criterion("exact_match", 1.0, exact_match)],
            sets=[JudgedCriteria(judge, criteria, max_episode_chars=2000)],
        )
        rollout = await calc_rollout(engine)
        started = time.perf_counter()
        scored = await score_rollout(rubric, rollout, rollout.task, now=time.time())
        out["judge_s"] = round(time.perf_counter() - started, 3)
        out["judge_scored"] = scored.scored
        out["judge_breakdown"] = [(c.name, c.score, c.reason[:80]) for c in scored.criteria]
        await judge.aclose()
    finally:
        await server.stop()
    return out


async def calc_rollout(engine: HFEngine) -> Any:
    from proto.messages import Rollout, Turn

    task = make_env("calc").task_source(difficulty=0, group_size=1, seed=0).task(0)
    answer = str(task.spec["answer"])
    turns = [
        Turn(role="user", token_ids=TOKENIZER.encode(task.prompt), text=task.prompt),
        Turn(role="assistant", token_ids=TOKENIZER.encode(answer), text=answer,
             logprobs=[-1.0] * len(answer), policy_version=engine.policy_version),
    ]  # fmt: skip
    return Rollout(
        rollout_id="gpu-judge", task_id=task.task_id, group_id=task.task_id, sample_index=0,
        env="calc", turns=turns, finish_reason="stop", task=task,
        env_info={"answer_correct": True, "expected": task.spec["answer"]},
    )  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    policy = PolicyConfig(preset=args.preset, device=args.device, seed=0)
    engine = build_engine(EngineConfig(max_batch_rows=64), policy)
    assert isinstance(engine, HFEngine)  # the figures below read its model
    batcher = GenerationBatcher(engine, batch_window_s=0.002)
    batcher.open.set()
    running = asyncio.create_task(batcher.run())
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": args.preset,
        "params": sum(p.numel() for p in engine.model.parameters()),
        "dtype": str(next(engine.model.parameters()).dtype),
    }
    with tempfile.TemporaryDirectory() as tmp:
        nats = NatsServer(store_dir=Path(tmp) / "nats")
        nats.start()
        try:
            result["harness"] = await harness(engine, batcher, nats.url, args.group)
        finally:
            nats.stop()
    result["serve"] = await serve_and_judge(engine, batcher)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="byte-0.5b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    out = args.out or result_file("gpu_agentic", result["device"])
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
