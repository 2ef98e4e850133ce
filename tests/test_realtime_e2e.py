"""Issue #6 end to end, over real HTTP on a real nats-server: a served generation, feedback
posted for it, the joined sample, an online trainer step that raises the accepted
completion's logprob, and the eval gate's promotion of the new version, which the serving
replica then takes.

The services run in this process as the real service objects (the way their `__main__`
runs them, less the health server): the trainer (online steps only, the gate on every
version), the weight-broadcaster, a serve-only rollout-worker that takes promoted versions
only, and the feedback-ingester. The test talks to them as a product would: the official
`openai` client for the completion, httpx for the feedback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.chat.template import chat_template_for
from libs.engine.factory import EngineConfig, build_engine
from libs.envs.client import EnvClient
from libs.envs.feeder import FeederConfig
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.rollout.agent import AgentSettings
from libs.rollout.evaluate import evaluate, mean_reward
from libs.serve.app import ServeConfig
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.trainer.eval_gate import EvalGateConfig, held_out_tasks
from libs.trainer.metrics import read_step_samples
from libs.trainer.online_step import OnlineConfig
from libs.weights.encoder import EncodeOptions
from proto import streams
from proto.messages import ChatMessage, OnlineSample, PromotionDecision, ServedGeneration
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.feedback_ingester.service import FeedbackIngesterService
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.feedback_support import auth, event_json, settings, stream_messages
from tests.signing_support import trusting

MODEL = "rlpipe-e2e"
SEED = 0  # the trainer's and the worker's initial weights (the worker's are replaced)
EVAL_TASKS = 4
MESSAGES = [{"role": "user", "content": "Say something nice."}]
# A readiness probe that no feedback can train on.
PROBE = {"prompt": "x", "max_tokens": 1, "training_eligible": False}


@dataclass
class Pipeline:
    trainer: TrainerService
    worker: RolloutWorkerService
    ingester: FeedbackIngesterService
    serve_url: str
    feedback_url: str


async def run_service(stack: AsyncExitStack, service: Service, bus: Bus) -> None:
    """Start `service` and run it until the stack closes (then stop it and wait for it)."""
    await service.start(bus)
    task = asyncio.create_task(service.run(), name=service.name)

    async def shut_down() -> None:
        await service.stop()
        await asyncio.wait_for(task, timeout=20)

    stack.push_async_callback(shut_down)


@pytest.fixture
async def pipeline(bus: Bus, tmp_path: Path) -> AsyncIterator[Pipeline]:
    await provision(bus.js)
    serve_port = free_port()
    trainer = TrainerService(
        TrainerSettings(
            run_dir=tmp_path,
            policy=PolicyConfig(device="cpu", seed=SEED),
            online=OnlineConfig(fraction=1.0, batch_samples=1),
            eval=EvalGateConfig(every_versions=1, num_tasks=EVAL_TASKS),
        )
    )
    broadcaster = WeightBroadcasterService(
        WeightBroadcasterSettings(run_dir=tmp_path, encode=EncodeOptions(threads=1))
    )
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="e2e-server",
            # Not the trainer's init: serving must wait for its weights.
            policy=PolicyConfig(device="cpu", seed=SEED + 1),
            consume_tasks=False,
            serve=ServeConfig(port=serve_port, model_name=MODEL),
            weights=trusting(promoted_only=True),
            drain_timeout_s=5.0,
        )
    )
    ingester = FeedbackIngesterService(settings(run_dir=tmp_path))
    serve_url = f"http://127.0.0.1:{serve_port}"
    async with AsyncExitStack() as stack:
        # env-gateway serves arith: the gate's held-out episodes run through it.
        gateway = EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off")))
        for service in (gateway, worker, broadcaster, ingester):
            await run_service(stack, service, bus)
        # No version promoted yet: the replica is up but has nothing to serve.
        async with httpx.AsyncClient(base_url=serve_url, timeout=10) as http:
            assert (await http.post("/v1/completions", json=PROBE)).status_code == 503
        await run_service(stack, trainer, bus)  # announces its weights; the gate promotes them
        assert ingester.api is not None
        yield Pipeline(
            trainer,
            worker,
            ingester,
            serve_url=serve_url,
            feedback_url=f"http://127.0.0.1:{ingester.api.port}",
        )


def completion_logprob(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> float:
    """Sum of the completion tokens' logprobs given the prompt (libs.policy's forward)."""
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids))  # type: ignore[arg-type]
    return float(logprobs[0, len(prompt) - 1 :].sum())


def trainer_steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "trainer" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_ids(run_dir: Path) -> list[list[str]]:
    """The sample ids of each trainer step (trainer/step_samples.jsonl)."""
    return [record.sample_ids for record in read_step_samples(run_dir)]


async def has_messages(bus: Bus, stream: str, num: int = 1) -> bool:
    return (await bus.js.stream_info(stream)).state.messages >= num


async def decisions(bus: Bus) -> list[PromotionDecision]:
    return await stream_messages(bus.js, streams.PROMOTIONS.name, PromotionDecision)


async def test_feedback_on_a_served_completion_trains_gates_and_serves_the_new_version(
    bus: Bus, pipeline: Pipeline, tmp_path: Path
) -> None:
    tokenizer = ByteTokenizer()
    client = AsyncOpenAI(base_url=f"{pipeline.serve_url}/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(base_url=pipeline.serve_url, timeout=30) as http:
        # 1. The serving replica serves once the gate's first promotion reached it.
        async def serving() -> bool:
            return (await http.post("/v1/completions", json=PROBE)).status_code == 200

        await wait_for(serving, timeout_s=30, what="the worker serving the first promoted version")
        assert pipeline.worker.engine_version == 0

        # 2. A served generation, through the official client.
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            n=1,
            max_tokens=12,
            temperature=1.0,
            seed=5,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        await client.close()
    chat = raw.parse()
    generation_id = raw.headers["x-generation-id"]
    assert raw.headers["x-generation-recorded"] == "true"
    (choice,) = chat.choices
    extra = choice.model_extra or {}
    assert extra["generation_id"] == generation_id and extra["policy_version"] == 0
    completion_ids: list[int] = extra["token_ids"]
    served_logprobs = [entry.logprob for entry in choice.logprobs.content]  # type: ignore[union-attr]
    prompt_ids = chat_template_for(tokenizer).render(
        [ChatMessage(role="user", content=MESSAGES[0]["content"])]
    )

    # 3. The product says the user accepted it.
    event = event_json("fb-e2e-1", generation_id, signal="accepted")
    async with httpx.AsyncClient(base_url=pipeline.feedback_url, timeout=10) as feedback:
        posted = await feedback.post("/v1/feedback", json=event, headers=auth())
    assert posted.status_code == 202, posted.text

    # 4. The join: one online sample with exactly the served tokens and logprobs.
    await wait_for(
        lambda: has_messages(bus, streams.ROLLOUTS_ONLINE.name),
        timeout_s=20,
        what="the joined online sample",
    )
    (sample,) = await stream_messages(bus.js, streams.ROLLOUTS_ONLINE.name, OnlineSample)
    served: ServedGeneration = sample.generation
    assert (sample.sample_id, sample.feedback.signal) == ("fb-e2e-1", "accepted")
    assert served.generation_id == generation_id and served.policy_version == 0
    assert served.prompt_token_ids == prompt_ids
    assert served.completion_token_ids == completion_ids
    assert served.logprobs == pytest.approx(served_logprobs)

    # 5. The trainer's online step on it, and the gate's decision on the version it made.
    await wait_for(
        lambda: ["fb-e2e-1"] in trained_ids(tmp_path),
        timeout_s=30,
        what="the trainer's online step on the sample",
    )
    (step,) = trainer_steps(tmp_path)
    assert (step["stream"], step["version"], step["mean_reward"]) == ("online", 1, 0.75)
    assert step["online_mean_advantage"] == pytest.approx(0.75)  # no baseline yet

    await wait_for(
        lambda: has_messages(bus, streams.PROMOTIONS.name, 2),
        timeout_s=30,
        what="the gate's decision on version 1",
    )
    first, second = await decisions(bus)
    assert (first.version, first.promoted, first.baseline_version) == (0, True, None)
    assert second.version == 1 and second.num_tasks == EVAL_TASKS
    assert (second.baseline_version, second.baseline_score) == (0, first.candidate_score)
    assert second.promoted == (second.candidate_score >= first.candidate_score - second.margin)
    assert second.promoted, second.reason

    # 6. The accepted completion is more likely under the new weights than under those
    # that served it: the trainer's model now, vs the served logprobs and the initial weights.
    trainer = pipeline.trainer.trainer
    assert trainer is not None and trainer.state.version == 1
    gate_tasks = held_out_tasks(EvalGateConfig(num_tasks=EVAL_TASKS))
    engine = build_engine(EngineConfig(), trainer.policy, trainer.model)
    scored = await evaluate(
        engine, tokenizer, gate_tasks, EnvClient(bus.nc), AgentSettings(max_turns=8)
    )
    assert mean_reward(scored) == second.candidate_score
    before_model = build_policy(PolicyConfig(preset="tiny", device="cpu", seed=SEED))
    before = completion_logprob(before_model, prompt_ids, completion_ids)
    after = completion_logprob(trainer.model, prompt_ids, completion_ids)
    assert before == pytest.approx(sum(served_logprobs), abs=1e-3)
    assert after > before, (before, after)

    # 7. The serving replica takes the promoted version and scores the completion as the
    # trainer does.
    worker = pipeline.worker
    await wait_for(lambda: worker.engine_version == 1, timeout_s=30, what="version 1 served")
    assert worker.batcher is not None
    scores = await worker.batcher.score([prompt_ids], [completion_ids])
    assert scores.policy_version == 1
    assert sum(scores.logprobs[0]) == pytest.approx(after, abs=1e-3)
    # The measured figures, shown with `pytest -s`.
    print(
        f"logprob before {before:.4f} after {after:.4f}; decision v1: "
        f"{second.candidate_score} vs v0 {second.baseline_score} -> {second.reason}"
    )
