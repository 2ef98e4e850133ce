"""Serve mode over real HTTP: a real uvicorn server, the tiny hf engine behind the generation
batcher, and a real nats-server holding the served-generation records. Responses are what
OpenAI clients expect (the official `openai` client included), logprobs and token ids are
exactly what the engine sampled, every choice is recorded under the id the caller got,
and bad requests get 4xx with an OpenAI error body."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI, BadRequestError

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.chat.template import chat_template_for
from libs.engine.base import SamplingParams
from libs.engine.hf import HFEngine
from libs.nats_server import free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout.batcher import GenerationBatcher
from libs.serve.app import OpenAIApi, ServeConfig, create_app
from libs.serve.choice import choice_probabilities, pick_choices
from libs.serve.generation import ServedPolicy
from libs.serve.records import GenerationRecorder
from libs.serve.server import ServeServer
from libs.tokenizer import ByteTokenizer
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import stage_weights
from proto import streams
from proto.messages import ChatMessage, ServedGeneration
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import state_trainer_policy, wait_for

TOKENIZER = ByteTokenizer()
TEMPLATE = chat_template_for(TOKENIZER)
EOS = TOKENIZER.eos_id
MODEL = "tiny-test"
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER)


@dataclass
class Serving:
    url: str
    http: httpx.AsyncClient
    bus: Bus
    recorder: GenerationRecorder

    async def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, json=body, **kwargs)


ServingFactory = Callable[..., Awaitable[Serving]]


@pytest.fixture
async def start_serving(bus: Bus, engine: HFEngine) -> AsyncIterator[ServingFactory]:
    """Starts the API over `engine` (through a running batcher) on a free port."""
    started: list[tuple[ServeServer, asyncio.Task[None], httpx.AsyncClient]] = []

    async def start(
        *, provisioned: bool = True, publisher: Publisher | None = None, **config: Any
    ) -> Serving:
        if provisioned:
            await provision(bus.js)
        batcher = GenerationBatcher(engine, batch_window_s=0.001)
        batcher.open.set()
        runner = asyncio.create_task(batcher.run())
        recorder = GenerationRecorder(publisher or Publisher(bus.js))
        served = ServedPolicy(batcher.generate, TOKENIZER, score=batcher.score, recorder=recorder)
        config.setdefault("model_name", MODEL)
        config.setdefault("default_max_tokens", 16)
        api = OpenAIApi(served, TEMPLATE, lambda: engine.policy_version, ServeConfig(**config))
        server = ServeServer(create_app(api), "127.0.0.1", 0, graceful_s=2)
        await server.start()
        url = f"http://127.0.0.1:{server.port}"
        http = httpx.AsyncClient(base_url=url, timeout=30)
        started.append((server, runner, http))
        return Serving(url, http, bus, recorder)

    yield start
    for server, runner, http in started:
        await http.aclose()
        await server.stop()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def records(bus: Bus) -> list[ServedGeneration]:
    """Every served-generation record on the stream, in order."""
    name = streams.SERVING_GENERATIONS.name
    info = await bus.js.stream_info(name)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        raw = await bus.js.get_msg(name, seq)
        out.append(wire.decode(ServedGeneration, raw.data or b"", dict(raw.headers or {})))
    return out


def chat_prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    return TEMPLATE.render([ChatMessage(role=m["role"], content=m["content"]) for m in messages])  # type: ignore[arg-type]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


# --- chat ----------------------------------------------------------------------------------


async def test_chat_completion_is_what_the_engine_sampled_and_is_recorded(
    start_serving: ServingFactory, engine: HFEngine
) -> None:
    serving = await start_serving()
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "return_token_ids": True,
        "metadata": {"session": "s-1"},
        "user": "user-7",
    }
    response = await serving.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["generation_id"] == out["id"]
    assert response.headers["x-generation-id"] == out["id"]
    assert response.headers["x-generation-recorded"] == "true"
    assert choice["message"]["role"] == "assistant"

    # Exactly the engine's own sample for this prompt and seed (one row, same RNG).
    prompt_ids = chat_prompt_ids(MESSAGES)
    params = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(EOS,), seed=3)
    expected = engine.generate([prompt_ids], params)[0]
    assert out["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected.token_ids
    assert choice["finish_reason"] == expected.finish_reason
    content = choice["logprobs"]["content"]
    assert len(content) == len(expected.token_ids)
    assert [entry["logprob"] for entry in content] == expected.logprobs
    assert all(entry["top_logprobs"] == [] for entry in content)
    assert TOKENIZER.decode(choice["token_ids"]) == choice["message"]["content"]
    assert out["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(expected.token_ids),
        "total_tokens": len(prompt_ids) + len(expected.token_ids),
    }

    (record,) = await records(serving.bus)
    assert record.generation_id == out["id"]
    assert record.prompt_token_ids == prompt_ids
    assert record.completion_token_ids == expected.token_ids
    assert record.logprobs == expected.logprobs
    assert record.policy_version == 0 and record.training_eligible
    assert (record.sampling.temperature, record.sampling.max_tokens) == (1.0, 12)
    assert record.metadata == {"session": "s-1", "user": "user-7"}
    assert record.created_at > 0


async def test_n_choices_each_get_an_id_and_a_record(start_serving: ServingFactory) -> None:
    serving = await start_serving()
    body = {"messages": MESSAGES, "n": 3, "max_tokens": 8, "training_eligible": False}
    response = await serving.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    ids = [choice["generation_id"] for choice in out["choices"]]
    assert ids == [f"{out['id']}-{i}" for i in range(3)]
    assert response.headers["x-generation-id"] == ",".join(ids)
    stored = await records(serving.bus)
    assert [r.generation_id for r in stored] == ids
    assert all(not r.training_eligible for r in stored)
    assert out["usage"]["completion_tokens"] == sum(len(r.completion_token_ids) for r in stored)


async def test_stop_string_cuts_the_text_but_not_the_recorded_tokens(
    start_serving: ServingFactory,
) -> None:
    serving = await start_serving()
    for seed in range(50):  # a seeded sample with a printable character to stop at
        body = {"messages": MESSAGES, "max_tokens": 24, "seed": seed, "return_token_ids": True}
        text = (await serving.post("/v1/chat/completions", body)).json()["choices"][0]["message"][
            "content"
        ]
        stop = next((c for c in text[1:] if c.isascii() and c.isprintable()), None)
        if stop is not None:
            break
    assert stop is not None, "no seeded sample holds a printable ASCII character"
    cut = (await serving.post("/v1/chat/completions", body | {"stop": stop})).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert TOKENIZER.decode(choice["token_ids"]).endswith(stop)  # tokens kept through it
    record = (await records(serving.bus))[-1]
    assert record.completion_token_ids == choice["token_ids"]


# --- legacy completions --------------------------------------------------------------------


async def test_completion_of_token_ids_with_legacy_logprobs(
    start_serving: ServingFactory, engine: HFEngine
) -> None:
    serving = await start_serving()
    prompt_ids = TOKENIZER.encode("Q: 2+2=")
    body = {
        "prompt": prompt_ids,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 0,
        "logprobs_mode": "raw_logprobs",
        "return_token_ids": True,
    }
    response = await serving.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    expected = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=10))[0]
    assert choice["token_ids"] == expected.token_ids
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"] == expected.raw_logprobs
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(expected.token_ids)
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])

    # The same prompt as text gives the same greedy completion; processed logprobs of a
    # greedy sample are 0 (a point mass), and that is what is recorded.
    as_text = await serving.post(
        "/v1/completions", body | {"prompt": "Q: 2+2=", "logprobs_mode": "processed_logprobs"}
    )
    choice_text = as_text.json()["choices"][0]
    assert choice_text["text"] == choice["text"] == TOKENIZER.decode(expected.token_ids)
    assert choice_text["logprobs"]["token_logprobs"] == [0.0] * len(expected.token_ids)
    first, second = await records(serving.bus)
    assert first.logprobs == second.logprobs == [0.0] * len(expected.token_ids)


# --- constrained choice --------------------------------------------------------------------


def test_choice_picks_follow_sequence_probabilities() -> None:
    assert choice_probabilities([-3.0, -1.0, -2.0], 0) == [0.0, 1.0, 0.0]
    probabilities = choice_probabilities([math.log(0.2), math.log(0.6)], 1.0)
    assert probabilities == pytest.approx([0.25, 0.75])
    picks = pick_choices([math.log(0.2), math.log(0.6)], 1.0, 4000, seed=0)
    assert picks.count(1) / 4000 == pytest.approx(0.75, abs=0.03)


def test_engine_scores_continuations_as_it_samples_them(engine: HFEngine) -> None:
    prompts = [TOKENIZER.encode("Q: 2+2="), TOKENIZER.encode("hello there")]
    sampled = engine.generate(prompts, SamplingParams(max_tokens=12, seed=5))
    scores = engine.score(prompts, [c.token_ids for c in sampled])
    assert scores.policy_version == engine.policy_version
    for completion, logprobs in zip(sampled, scores.logprobs, strict=True):
        assert torch.allclose(
            torch.tensor(logprobs), torch.tensor(completion.raw_logprobs), atol=1e-4
        )


@pytest.mark.parametrize("form", ["guided_choice", "structured_outputs"])
async def test_guided_choice_answers_with_the_most_likely_choice(
    start_serving: ServingFactory, engine: HFEngine, form: str
) -> None:
    serving = await start_serving()
    choices = ["yes", "no", "maybe"]
    constraint: dict[str, Any] = (
        {"guided_choice": choices}
        if form == "guided_choice"
        else {"structured_outputs": {"choice": choices}}
    )
    body = {"messages": MESSAGES, "temperature": 0, "logprobs": True, "return_token_ids": True}
    response = await serving.post("/v1/chat/completions", body | constraint)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt_ids = chat_prompt_ids(MESSAGES)
    sequences = [[*TOKENIZER.encode(c), EOS] for c in choices]
    scores = engine.score([prompt_ids] * 3, sequences).logprobs
    best = max(range(3), key=lambda i: sum(scores[i]))
    assert choice["message"]["content"] == choices[best]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == sequences[best]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert logprobs == pytest.approx(scores[best], abs=1e-5)
    (record,) = await records(serving.bus)
    assert record.completion_token_ids == sequences[best]
    assert record.metadata["rlpipe_constraint"] == "choice"
    assert not record.training_eligible  # picked among sequences: no behavior logprobs


async def test_sampled_choices_are_always_among_the_given_ones(
    start_serving: ServingFactory,
) -> None:
    serving = await start_serving()
    body = {"prompt": "Is it? ", "guided_choice": ["A", "B"], "n": 8, "temperature": 1.0}
    response = await serving.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert {c["text"] for c in response.json()["choices"]} <= {"A", "B"}


# --- errors --------------------------------------------------------------------------------


async def test_bad_requests_get_openai_errors(start_serving: ServingFactory) -> None:
    serving = await start_serving()
    chat = "/v1/chat/completions"
    bad_json = await serving.http.post(
        chat, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_openai_error(bad_json, 400)
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": MESSAGES, "top_logprobs": 2, "logprobs": True}, 400, "top_logprobs"),
        ({"messages": MESSAGES, "stream": True}, 400, "stream"),
        ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"messages": MESSAGES, "n": 99}, 400, "n"),
        ({"messages": MESSAGES, "guided_choice": []}, 400, "guided_choice"),
        ({"messages": MESSAGES, "structured_outputs": {"regex": "a+"}}, 400, None),
        ({"messages": []}, 400, "messages"),
        ({"messages": MESSAGES, "model": "gpt-9"}, 404, "model"),
        ({"messages": MESSAGES, "max_tokens": 9000}, 400, None),  # over the positions
    ]
    for body, status, param in cases:
        assert_openai_error(await serving.post(chat, body), status, param)
    completions = "/v1/completions"
    assert_openai_error(await serving.post(completions, {"prompt": ""}), 400, "prompt")
    assert_openai_error(await serving.post(completions, {"prompt": [10**6]}), 400)
    assert_openai_error(await serving.post(completions, {"prompt": "x", "logprobs": 2}), 400)
    assert_openai_error(await serving.post(completions, ["not", "an", "object"]), 400)
    assert_openai_error(await serving.http.get("/v1/nothing"), 404)
    assert_openai_error(await serving.http.get(chat), 405)
    assert await records(serving.bus) == []


async def test_api_key_is_required_when_configured(start_serving: ServingFactory) -> None:
    serving = await start_serving(api_key="s3cret")
    assert_openai_error(await serving.http.get("/v1/models"), 401)
    wrong = {"authorization": "Bearer nope"}
    assert_openai_error(await serving.post("/v1/completions", {"prompt": "x"}, headers=wrong), 401)
    ok = await serving.http.get("/v1/models", headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


async def test_a_lost_record_is_counted_and_the_answer_still_goes_out(
    start_serving: ServingFactory, bus: Bus
) -> None:
    # No generations stream on the bus: every record publish fails.
    serving = await start_serving(
        provisioned=False,
        publisher=Publisher(bus.js, ack_timeout_s=0.2, max_attempts=1, retry_window_s=0.0),
    )
    response = await serving.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.headers["x-generation-recorded"] == "false"
    assert serving.recorder.num_lost == 1 and serving.recorder.num_recorded == 0


# --- the official client -------------------------------------------------------------------


async def test_the_official_openai_client_talks_to_it(start_serving: ServingFactory) -> None:
    serving = await start_serving(api_key="client-key")
    client = AsyncOpenAI(base_url=f"{serving.url}/v1", api_key="client-key", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            logprobs=True,
            seed=1,
        )
        choice = chat.choices[0]
        assert isinstance(choice.message.content, str) and choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert len(choice.logprobs.content) == chat.usage.completion_tokens  # type: ignore[union-attr]
        assert (choice.model_extra or {})["generation_id"] == chat.id
        text = await client.completions.create(model=MODEL, prompt="2+2=", max_tokens=6)
        assert text.choices[0].finish_reason in ("stop", "length")
        judged = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is 2+2=4? Answer yes or no."}],
            temperature=0,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert judged.choices[0].message.content in ("yes", "no")
        with pytest.raises(BadRequestError, match="top_logprobs"):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                logprobs=True,
                top_logprobs=3,
            )
    finally:
        await client.close()
    ids = {r.generation_id for r in await records(serving.bus)}
    assert {chat.id, text.id, judged.id} <= ids


# --- the rollout-worker in serve mode ------------------------------------------------------


async def test_rollout_worker_serves_and_records(bus: Bus, tmp_path: Path) -> None:
    await provision(bus.js)
    await state_trainer_policy(bus.js)  # the test stages the trainer's weights itself
    broadcaster = WeightBroadcasterService(
        WeightBroadcasterSettings(staging_dir=tmp_path / "staging", encode=EncodeOptions(threads=1))
    )
    port = free_port()
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="server-test",
            policy=PolicyConfig(device="cpu"),
            consume_tasks=False,
            serve=ServeConfig(port=port, model_name=MODEL),
            drain_timeout_s=5.0,
        )
    )
    running = []
    for service in (broadcaster, worker):
        await service.start(bus)
        running.append((service, asyncio.create_task(service.run())))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            body = {"messages": MESSAGES, "max_tokens": 6}
            not_ready = await http.post("/v1/chat/completions", json=body)
            assert_openai_error(not_ready, 503)
            assert not_ready.headers["retry-after"] == "1"

            state = build_policy(PolicyConfig(seed=11)).state_dict()
            await stage_weights(Publisher(bus.js), tmp_path / "staging", state, 0)
            await wait_for(lambda: worker.health()["status"] == "ok", 20, "weights applied")
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            out = response.json()
            assert out["choices"][0]["policy_version"] == 0
        (record,) = await records(bus)
        assert record.generation_id == out["id"] and record.policy_version == 0
        assert worker.health()["generations_recorded"] == 1
        assert worker.health()["detail"].endswith("serving only")
    finally:
        for service, task in reversed(running):
            await service.stop()
            await asyncio.wait_for(task, timeout=10)


def test_a_worker_that_neither_consumes_nor_serves_is_refused() -> None:
    with pytest.raises(ValueError, match="SERVE_PORT"):
        RolloutWorkerSettings(consume_tasks=False, serve=ServeConfig(port=0))


async def test_a_fixed_weights_replica_serves_at_once_and_ignores_new_versions(
    bus: Bus, tmp_path: Path
) -> None:
    """follow_weights=false: a judge or baseline replica serves its loaded weights."""
    await provision(bus.js)
    port = free_port()
    worker = RolloutWorkerService(
        RolloutWorkerSettings(
            worker_id="fixed-judge", policy=PolicyConfig(device="cpu", seed=3),
            consume_tasks=False,
            follow_weights=False, serve=ServeConfig(port=port, model_name=MODEL),
            drain_timeout_s=5.0,
        )
    )  # fmt: skip
    await worker.start(bus)
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: worker.health()["status"] == "ok", 20, "serving")
        assert worker.engine is not None
        live = worker.engine.live_tensors()
        assert live is not None
        before = {n: t.clone() for n, t in live.items()}
        # A new version on the bus: a fixed replica must not take it.
        broadcaster = WeightBroadcasterService(
            WeightBroadcasterSettings(
                staging_dir=tmp_path / "staging", encode=EncodeOptions(threads=1)
            )
        )
        await broadcaster.start(bus)
        broadcasting = asyncio.create_task(broadcaster.run())
        state = build_policy(PolicyConfig(seed=11)).state_dict()
        await stage_weights(Publisher(bus.js), tmp_path / "staging", state, 1)
        await wait_for(lambda: announced(bus), 20, "version 1 announced")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            body = {"messages": MESSAGES, "max_tokens": 4}
            response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["policy_version"] == 0
        assert all(torch.equal(before[n], live[n]) for n in before)
        await broadcaster.stop()
        await asyncio.wait_for(broadcasting, timeout=10)
    finally:
        await worker.stop()
        await asyncio.wait_for(running, timeout=10)


async def announced(bus: Bus) -> bool:
    info = await bus.js.stream_info(streams.WEIGHTS_ANNOUNCE.name)
    return info.state.messages > 0
