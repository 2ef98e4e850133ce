"""Serve mode cannot stall training: keys, request bounds, admission control (429), the
engine's share for rollouts and weight swaps, abandoned requests, SIGTERM.

Real HTTP against a real uvicorn server over the tiny hf engine behind the generation
batcher; a real rollout-worker process for SIGTERM. Long generations are greedy (the tiny
random model then never samples eos), so a request lasts as long as its max_tokens says.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from libs.chat.template import chat_template_for
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.nats_server import NatsServer, free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout.batcher import GenerationBatcher
from libs.serve.app import OpenAIApi, create_app
from libs.serve.config import ServeConfig, ServeKeyEntry, hash_key
from libs.serve.generation import ServedPolicy
from libs.serve.holds import generate_in_holds
from libs.serve.server import ServeServer
from libs.tokenizer import ByteTokenizer
from tests.conftest import wait_for
from tests.test_service import http_get, wait_http_ok

TOKENIZER = ByteTokenizer()
MODEL = "tiny-test"
# Greedy and long: rows of the tiny random model run to max_tokens.
LONG = {"prompt": "hello", "temperature": 0, "max_tokens": 2048}


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER)


@dataclass
class Replica:
    url: str
    http: httpx.AsyncClient
    api: OpenAIApi
    batcher: GenerationBatcher

    async def complete(self, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return await self.http.post("/v1/completions", json={"model": MODEL} | body, **kwargs)

    def flood(self, count: int, body: dict[str, Any], **kwargs: Any) -> list[asyncio.Task[Any]]:
        return [asyncio.create_task(self.complete(body, **kwargs)) for _ in range(count)]


ReplicaFactory = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def start_replica(engine: HFEngine) -> AsyncIterator[ReplicaFactory]:
    """Serve mode over `engine` through a running batcher (no records), on a free port."""
    started: list[tuple[ServeServer, asyncio.Task[None], httpx.AsyncClient]] = []

    async def start(**config: Any) -> Replica:
        serve = ServeConfig(model_name=MODEL, **config)
        batcher = GenerationBatcher(engine, batch_window_s=0.001, served_share=serve.engine_share)
        batcher.open.set()
        runner = asyncio.create_task(batcher.run())
        served = ServedPolicy(
            batcher.generate_served, TOKENIZER, hold_tokens=serve.hold_tokens,
            max_context_tokens=engine.max_context_tokens,
        )  # fmt: skip
        api = OpenAIApi(served, chat_template_for(TOKENIZER), lambda: 0, serve)
        server = ServeServer(
            create_app(api), "127.0.0.1", 0, 2, serve.http_limits(), on_grace_over=api.stop_open
        )
        await server.start()
        url = f"http://127.0.0.1:{server.port}"
        http = httpx.AsyncClient(base_url=url, timeout=120)
        started.append((server, runner, http))
        return Replica(url, http, api, batcher)

    yield start
    for server, runner, http in started:
        await http.aclose()
        await server.stop()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# --- keys ------------------------------------------------------------------------------


def test_a_replica_listening_beyond_loopback_needs_a_key() -> None:
    with pytest.raises(ValidationError, match="RLPIPE_ROLLOUT_WORKER_SERVE_API_KEY"):
        ServeConfig(port=8000, host="0.0.0.0")
    with pytest.raises(ValidationError, match="beyond loopback"):
        ServeConfig(port=8000, host="serve.example.com")
    ServeConfig(port=8000, host="0.0.0.0", api_key="s3cret")
    entry = ServeKeyEntry(name="acme", sha256=hash_key(b"k"))
    ServeConfig(port=8000, host="::", api_keys=[entry])
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        ServeConfig(port=8000, host=loopback)
    ServeConfig(port=0, host="0.0.0.0")  # serve mode off: nothing listens


async def test_a_non_ascii_bearer_token_is_a_401_not_a_500(start_replica: ReplicaFactory) -> None:
    replica = await start_replica(api_key="s3cret")
    for token in ("Bearer clé".encode(), "Bearer clé".encode("latin-1"), b"Bearer \xff\xfe"):
        response = await replica.http.get("/v1/models", headers={"authorization": token})
        assert response.status_code == 401, response.text
        assert error_of(response)["code"] == "invalid_api_key"
    ok = await replica.http.get("/v1/models", headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200


async def test_a_non_ascii_key_that_is_configured_is_accepted(
    start_replica: ReplicaFactory,
) -> None:
    replica = await start_replica(api_key="clé-ü")
    good = await replica.http.get("/v1/models", headers={"authorization": "Bearer clé-ü".encode()})
    assert good.status_code == 200


# --- request bounds --------------------------------------------------------------------


async def test_request_bounds_are_400s_that_name_the_limit(start_replica: ReplicaFactory) -> None:
    replica = await start_replica(max_tokens=512, max_stop=16, max_stop_chars=64)
    cases = [
        ({"max_tokens": 513}, "max_tokens", "serve.max_tokens"),
        ({"stop": [f"stop-{i}" for i in range(1000)]}, "stop", "serve.max_stop"),
        ({"stop": "x" * 65}, "stop", "serve.max_stop_chars"),
    ]
    for body, param, limit in cases:
        response = await replica.complete({"prompt": "hi"} | body)
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == param and limit in error_of(response)["message"]
    chat = await replica.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600},
    )
    assert chat.status_code == 400 and "serve.max_tokens" in error_of(chat)["message"]
    ok = await replica.complete({"prompt": "hi", "max_tokens": 4, "stop": ["a"] * 16})
    assert ok.status_code == 200, ok.text


async def test_a_request_over_a_keys_token_budget_is_refused_as_never_servable(
    start_replica: ReplicaFactory,
) -> None:
    replica = await start_replica(max_tokens_per_key=1000)
    response = await replica.complete({"prompt": "hi", "n": 4, "max_tokens": 300})
    assert response.status_code == 400
    assert "serve.max_tokens_per_key" in error_of(response)["message"]


# --- admission -------------------------------------------------------------------------


async def test_a_full_replica_answers_429_with_retry_after(start_replica: ReplicaFactory) -> None:
    replica = await start_replica(
        max_running_requests=1, max_queued_requests=1, busy_retry_after_s=3, hold_tokens=16
    )
    admission = replica.api.admission
    open_requests = replica.flood(2, LONG)
    await wait_for(lambda: admission.num_running == 1 and admission.num_queued == 1)

    refused = await asyncio.gather(*replica.flood(3, LONG | {"max_tokens": 4}))
    for response in refused:
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "3"
        assert error_of(response)["code"] == "rate_limit_exceeded"
    assert not any(task.done() for task in open_requests)

    await cancel_all(open_requests)  # the clients go away: their slots come back
    await wait_for(lambda: admission.num_running == 0 and admission.num_queued == 0)
    assert (await replica.complete({"prompt": "hi", "max_tokens": 4})).status_code == 200


async def test_each_key_has_its_own_request_and_token_budget(
    start_replica: ReplicaFactory,
) -> None:
    keys = [ServeKeyEntry(name=name, sha256=hash_key(name.encode())) for name in ("a", "b")]
    replica = await start_replica(
        api_keys=keys, max_requests_per_key=1, max_running_requests=4, hold_tokens=16
    )
    as_a, as_b = ({"headers": {"authorization": f"Bearer {k}"}} for k in ("a", "b"))
    busy_a = replica.flood(1, LONG, **as_a)
    await wait_for(lambda: replica.api.admission.num_running == 1)

    second_a = await replica.complete({"prompt": "hi", "max_tokens": 4}, **as_a)
    assert second_a.status_code == 429 and "of this key" in error_of(second_a)["message"]
    first_b = await replica.complete({"prompt": "hi", "max_tokens": 4}, **as_b)
    assert first_b.status_code == 200, first_b.text
    await cancel_all(busy_a)


# --- the engine: rollouts first, abandoned requests stop -------------------------------


async def test_rollouts_and_weight_swaps_go_on_while_served_requests_flood_the_engine(
    start_replica: ReplicaFactory,
) -> None:
    replica = await start_replica(
        max_running_requests=4, max_queued_requests=4, hold_tokens=16, engine_share=0.25
    )
    batcher = replica.batcher
    flood = replica.flood(4, LONG | {"n": 16})
    await wait_for(lambda: batcher.num_served_in_engine > 0, what="served holds in the engine")

    rollout_params = SamplingParams(max_tokens=8, seed=1)
    for _ in range(3):  # each rollout call gets the engine while the flood still generates
        completions = await batcher.generate([TOKENIZER.encode("2+2=")] * 8, rollout_params)
        assert len(completions) == 8
        async with batcher.gate:  # what a weight swap takes
            assert not any(task.done() for task in flood)
    assert replica.api.admission.num_running == 4  # the flood is admitted, not refused
    await cancel_all(flood)


async def test_a_disconnected_request_stops_generating(start_replica: ReplicaFactory) -> None:
    replica = await start_replica(hold_tokens=16)
    batcher, admission = replica.batcher, replica.api.admission
    abandoned = replica.flood(1, LONG | {"n": 16})
    await wait_for(lambda: batcher.num_served_in_engine > 0, what="the request in the engine")

    await cancel_all(abandoned)  # httpx closes the connection
    await wait_for(lambda: admission.num_running == 0, what="the request abandoned")
    await wait_for(lambda: batcher.num_served_in_engine == 0, what="its hold to end")
    holds = batcher.num_calls
    assert holds < 2048 // 16  # far from its 2,048 tokens

    assert (await replica.complete({"prompt": "hi", "max_tokens": 4})).status_code == 200
    assert batcher.num_calls == holds + 1  # no hold of the abandoned request started since


async def test_holds_continue_exactly_where_the_last_one_stopped(engine: HFEngine) -> None:
    prompt = TOKENIZER.encode("hello")
    params = SamplingParams(temperature=0, max_tokens=100)
    [whole] = engine.generate([prompt], params, 1)
    calls: list[int] = []

    async def generate(prompts: list[list[int]], hold: SamplingParams) -> list[Completion]:
        calls.append(len(prompts[0]))
        return engine.generate(prompts, hold, 1)

    [held] = await generate_in_holds(
        generate, prompt, 1, params, hold_tokens=16, tokenizer=TOKENIZER
    )
    assert calls == [len(prompt) + 16 * k for k in range(7)]  # 6 holds of 16, one of 4
    assert held.token_ids == whole.token_ids and held.finish_reason == "length"
    assert held.raw_logprobs == whole.raw_logprobs  # the KV cache carried over, not redone


async def test_a_seeded_request_in_holds_samples_what_one_call_would(engine: HFEngine) -> None:
    async def generate(prompts: list[list[int]], hold: SamplingParams) -> list[Completion]:
        return engine.generate(prompts, hold, 1)

    prompt = TOKENIZER.encode("hello")
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=7)
    wholes = engine.generate([prompt] * 4, params, 1)
    helds = await generate_in_holds(generate, prompt, 4, params, hold_tokens=8, tokenizer=TOKENIZER)
    for whole, held in zip(wholes, helds, strict=True):
        assert held.token_ids == whole.token_ids and held.logprobs == whole.logprobs


async def test_a_stop_string_that_spans_two_holds_ends_the_completion(engine: HFEngine) -> None:
    prompt = TOKENIZER.encode("hello")  # greedy: "ooooo..."
    params = SamplingParams(temperature=0, max_tokens=64, stop_strings=("o" * 20,))
    [whole] = engine.generate([prompt], params, 1)

    async def generate(prompts: list[list[int]], hold: SamplingParams) -> list[Completion]:
        return engine.generate(prompts, hold, 1)

    [held] = await generate_in_holds(
        generate, prompt, 1, params, hold_tokens=16, tokenizer=TOKENIZER
    )
    assert len(whole.token_ids) == 20 and whole.finish_reason == "stop"
    assert held.token_ids == whole.token_ids and held.finish_reason == "stop"


async def test_a_weight_swap_between_holds_is_reported_as_the_version_it_ended_on() -> None:
    engine = HFEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER)
    calls = 0

    async def generate(prompts: list[list[int]], hold: SamplingParams) -> list[Completion]:
        nonlocal calls
        calls += 1
        if calls == 2:  # a swap between the first and the second hold
            tensors = engine.live_tensors() or {}
            engine.update_weights({name: t.clone() for name, t in tensors.items()}, 7)
        return engine.generate(prompts, hold, 1)

    params = SamplingParams(temperature=0, max_tokens=48)
    completions = await generate_in_holds(
        generate, TOKENIZER.encode("hello"), 2, params, hold_tokens=16, tokenizer=TOKENIZER
    )
    for completion in completions:
        assert (completion.policy_version, completion.policy_version_end) == (0, 7)
        assert len(completion.token_ids) == 48


# --- SIGTERM ---------------------------------------------------------------------------


def test_sigterm_ends_a_flooded_serving_replica_within_its_grace(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    serve_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_LOG_FORMAT": "json",
        "RLPIPE_ROLLOUT_WORKER_HTTP_PORT": str(http_port),
        "RLPIPE_ROLLOUT_WORKER_SERVE_PORT": str(serve_port),
        "RLPIPE_ROLLOUT_WORKER_SERVE_MODEL_NAME": MODEL,
        "RLPIPE_ROLLOUT_WORKER_CONSUME_TASKS": "false",
        "RLPIPE_ROLLOUT_WORKER_FOLLOW_WEIGHTS": "false",
        "RLPIPE_ROLLOUT_WORKER_DRAIN_TIMEOUT_S": "2",
        "OMP_NUM_THREADS": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.rollout_worker"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    clients: list[socket.socket] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{http_port}/healthz", process)
        body = json.dumps({"model": MODEL} | LONG | {"n": 16}).encode()
        for _ in range(4):  # four long requests whose clients stay connected
            client = socket.create_connection(("127.0.0.1", serve_port))
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            clients.append(client)
        url = f"http://127.0.0.1:{http_port}/healthz"
        wait_until(lambda: json.loads(http_get(url)[1]).get("serve_requests_in_engine", 0) > 0)
        process.send_signal(signal.SIGTERM)
        # Without holds the replica would decode its 4 x 16 x 2,048 tokens first (minutes).
        _, stderr = process.communicate(timeout=60)
        answers = [read_all(client) for client in clients]
    finally:
        for client in clients:
            client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "service stopped"
    for answer in answers:  # the graceful time (2 s) ran out: answered, not dropped
        assert answer.startswith(b"HTTP/1.1 503") and b"server_stopping" in answer, answer


def read_all(client: socket.socket) -> bytes:
    client.settimeout(60)  # against a hang only: the server has exited
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


def wait_until(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    """Poll `condition` (a deadline against a hang only)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.05)
