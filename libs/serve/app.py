"""The OpenAI-compatible API of serve mode: a FastAPI app over a `ServedPolicy`.

    GET  /v1/models             the served model (and the policy version it runs now)
    POST /v1/chat/completions   messages -> chat.completion
    POST /v1/completions        prompt (text or token ids) -> text_completion

What the official `openai` client, vLLM's and SGLang's clients send works: the request
fields are in `libs.serve.protocol`, the response bodies in `libs.serve.responses`. Each
choice's generation id is in the choice (`generation_id`) and, comma-separated in choice
order, in the `X-Generation-Id` header; `X-Generation-Recorded: true|false` says whether
the generations are stored on the bus (absent when recording is off).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
body the API cannot serve (bad JSON, a bad or unsupported field, a bound passed: `n`,
`max_tokens`, `stop`; named in `param`), 401 without a configured key
(`Authorization: Bearer <key>`), 404 for another model name, 413 for a body over the limit,
429 when admission control is full (libs.serve.admission; Retry-After), 503 while the worker
has no weights yet or is lent to RL (libs/fleet/lending.py; Retry-After), 409
`policy_version_unavailable` (Retry-After) when the request's `rl_policy` asks for a version
this replica cannot serve (the rollout contract: libs.serve.contract), and 500 only for our
own failures.

A request whose client disconnects is abandoned at once: its generation is cancelled (the
hold running in the engine ends, no next one starts) and nothing is recorded. When the
server stops, open requests get its graceful time to finish; then `stop_open` cancels the
rest, which are answered 503 (Retry-After) before the connections close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from libs.chat.template import ChatTemplate
from libs.engine.base import SamplingParams
from libs.rollout.version_book import VersionBook
from libs.serve.admission import Admission, AdmissionLimits
from libs.serve.config import ServeConfig, hash_key
from libs.serve.contract import refuse_unless_held, refuse_unless_kept, requirement_of
from libs.serve.generation import GenerationRequest, ServedPolicy, ServedResult
from libs.serve.protocol import (
    ApiError,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    invalid,
    parse_request,
)
from libs.serve.responses import BodyOptions, chat_completion_body, completion_body, models_body
from proto.messages import ChatMessage
from proto.rollout_contract import PolicyRequirement

log = structlog.get_logger(__name__)

REQUESTS = Counter(
    "rlpipe_serve_requests_total",
    "Serve-mode API requests by route and status",
    ["route", "status"],
)
REQUEST_SECONDS = Histogram(
    "rlpipe_serve_request_seconds",
    "Time from request to answer, generation and record included",
    ["route"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

# What legacy completions generate when max_tokens is unset (OpenAI's and vLLM's default).
LEGACY_DEFAULT_MAX_TOKENS = 16
GENERATION_ID_HEADER = "X-Generation-Id"
RECORDED_HEADER = "X-Generation-Recorded"
# Not sent (the client is gone); the status requests_total counts an abandoned request under.
CLIENT_CLOSED = 499
ANONYMOUS = "anonymous"
"""The budget requests share when no key is configured (loopback only)."""

Reply = tuple[dict[str, Any], dict[str, str]]
T = TypeVar("T")


class OpenAIApi:
    """What the routes do apart from HTTP: check, render, serve, shape the answer."""

    def __init__(
        self,
        served: ServedPolicy,
        template: ChatTemplate,
        policy_version: Callable[[], int | None],
        config: ServeConfig,
        versions: VersionBook | None = None,
    ) -> None:
        self.served = served
        self.template = template
        self.policy_version = policy_version
        self.config = config
        # Names versions by number and manifest hash (the weights follower's book).
        self.versions = versions or VersionBook()
        self.started = int(time.time())
        self.admission = Admission(
            AdmissionLimits(
                max_running=config.max_running_requests,
                max_queued=config.max_queued_requests,
                max_requests_per_key=config.max_requests_per_key,
                max_tokens_per_key=config.max_tokens_per_key,
                retry_after_s=config.busy_retry_after_s,
            )
        )
        self._keys = config.key_hashes()
        self._open: set[asyncio.Task[Any]] = set()

    def stop_open(self) -> None:
        """Cancel every open request's work: each is answered 503 (the server stops)."""
        for task in self._open:
            task.cancel()

    async def unless_disconnected(self, request: Request, work: Coroutine[Any, Any, T]) -> T:
        """What `work` returns; if the client disconnects first, `work` is cancelled (and
        awaited) and ClientDisconnect raised; if `stop_open` cancelled it, a 503."""
        task = asyncio.ensure_future(work)
        self._open.add(task)
        task.add_done_callback(self._open.discard)
        watch = asyncio.ensure_future(_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled
            if not task.done():
                task.cancel()
            watch.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if task not in done:
            raise ClientDisconnect()
        if task.cancelled():
            raise ApiError(
                503,
                "the server is stopping; retry (another replica)",
                type="server_error",
                code="server_stopping",
                retry_after_s=self.config.not_ready_retry_after_s,
            )
        return task.result()

    def authorize(self, authorization: str | None) -> str:
        """The name of the caller's key (`anonymous` when no key is configured); 401 else."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        # Headers arrive as latin-1 text: its bytes are what the client sent, any of 256
        # values; compared as sha256 hex, so a non-ASCII key is a wrong key, not a crash.
        presented = hash_key(key.strip().encode("latin-1"))
        name = next((n for h, n in self._keys.items() if hmac.compare_digest(h, presented)), None)
        if scheme.lower() != "bearer" or name is None:
            raise ApiError(
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )
        return name

    def models(self) -> dict[str, Any]:
        return models_body(self.config.model_name, self.started, self.policy_version())

    async def chat(self, body: Any, key: str) -> Reply:
        request = parse_request(ChatRequest, body)
        max_tokens = (
            request.max_completion_tokens or request.max_tokens or self.config.default_max_tokens
        )
        requirement = self._admit(request, max_tokens)
        messages = [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
            for m in request.messages
        ]
        prompt_ids = self.template.render(messages)
        stop_ids = self.template.stop_token_ids
        params = _sampling_params(request, max_tokens, stop_ids)
        generation = self._kept(
            requirement, _generation(request, prompt_ids, params, "chatcmpl", stop_ids[:1])
        )
        result = await self._serve(generation, key)
        options = self._options(request, prompt_ids, request.logprobs, requirement)
        return chat_completion_body(result, options), _headers(result)

    async def completions(self, body: Any, key: str) -> Reply:
        request = parse_request(CompletionRequest, body)
        max_tokens = request.max_tokens or LEGACY_DEFAULT_MAX_TOKENS
        requirement = self._admit(request, max_tokens)
        prompt = request.prompt
        prompt_ids = self.served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not prompt_ids:
            raise invalid("prompt has no tokens", "prompt")
        params = _sampling_params(request, max_tokens, ())
        eos = (self.served.tokenizer.eos_id,)
        generation = self._kept(requirement, _generation(request, prompt_ids, params, "cmpl", eos))
        result = await self._serve(generation, key)
        options = self._options(request, prompt_ids, request.logprobs is not None, requirement)
        return completion_body(result, options), _headers(result)

    async def _serve(self, generation: GenerationRequest, key: str) -> ServedResult:
        """Serve `generation` once admission control lets `key` in (429 when full)."""
        rows = len(generation.choices or ()) or generation.num_choices
        cost = rows * (len(generation.prompt_ids) + generation.params.max_tokens)
        async with self.admission.admit(key, cost):
            return await self.served.serve(generation)

    def _admit(self, request: CommonRequest, max_tokens: int) -> PolicyRequirement | None:
        """The request's `rl_policy`; 404 for another model, 400 past a request bound, 503
        without weights, 409 without the version `rl_policy` requires."""
        name = self.config.model_name
        if request.model is not None and request.model != name:
            raise ApiError(
                404,
                f"model {request.model!r} is not served here; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        check_bounds(request, max_tokens, self.config)
        requirement = requirement_of(request)  # 400 before 503: a malformed one never serves
        held = self.policy_version()
        if held is None:
            raise ApiError(
                503,
                "the model is not ready to serve (no weights yet, or this replica is lent to RL); "
                "retry, on another replica",
                type="server_error",
                code="model_not_ready",
                retry_after_s=self.config.not_ready_retry_after_s,
            )
        retry_after_s = self.config.not_ready_retry_after_s
        refuse_unless_held(requirement, self.versions.ref(held), retry_after_s)
        return requirement

    def _kept(
        self, requirement: PolicyRequirement | None, generation: GenerationRequest
    ) -> GenerationRequest:
        """`generation`, refused after generating when a swap broke `requirement` (an exact
        version): nothing of it is recorded."""
        if requirement is None:
            return generation
        accept = functools.partial(
            refuse_unless_kept,
            requirement,
            versions=self.versions,
            retry_after_s=self.config.not_ready_retry_after_s,
        )
        return dataclasses.replace(generation, accept=accept)

    def _options(
        self,
        request: CommonRequest,
        prompt_ids: list[int],
        logprobs: bool,
        requirement: PolicyRequirement | None,
    ) -> BodyOptions:
        return BodyOptions(
            model=self.config.model_name,
            prompt_ids=prompt_ids,
            tokenizer=self.served.tokenizer,
            logprobs=logprobs,
            logprobs_mode=request.logprobs_mode,
            return_token_ids=request.return_token_ids,
            versions=self.versions,
            raw_logprobs=requirement is not None and requirement.return_raw_logprobs,
        )


def check_bounds(request: CommonRequest, max_tokens: int, config: ServeConfig) -> None:
    """400 naming the bound a request passes: `n`, `max_tokens`, `stop` (count, length)."""
    if request.n > config.max_choices:
        raise invalid(f"n must be <= {config.max_choices}, got {request.n}", "n")
    if max_tokens > config.max_tokens:
        raise invalid(
            f"max_tokens must be <= {config.max_tokens} (serve.max_tokens), got {max_tokens}",
            "max_tokens",
        )
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > config.max_stop:
        raise invalid(
            f"stop may hold at most {config.max_stop} strings (serve.max_stop), got {len(stops)}",
            "stop",
        )
    longest = max((len(text) for text in stops), default=0)
    if longest > config.max_stop_chars:
        raise invalid(
            f"a stop string may be at most {config.max_stop_chars} characters "
            f"(serve.max_stop_chars), got {longest}",
            "stop",
        )


def _sampling_params(
    request: CommonRequest, max_tokens: int, stop_ids: tuple[int, ...]
) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=max_tokens,
            stop_token_ids=(*stop_ids, *(request.stop_token_ids or ())),
            stop_strings=request.stop_strings(),
            seed=request.seed,
        )
    except ValueError as exc:
        raise invalid(str(exc)) from exc


def _generation(
    request: CommonRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    id_prefix: str,
    choice_end_ids: tuple[int, ...],
) -> GenerationRequest:
    metadata = dict(request.metadata or {})
    if request.user is not None:
        metadata.setdefault("user", request.user)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        params=params,
        num_choices=request.n,
        id_prefix=id_prefix,
        choices=request.choices(),
        choice_end_ids=choice_end_ids,
        metadata=metadata,
        training_eligible=request.training_eligible,
    )


def _headers(result: ServedResult) -> dict[str, str]:
    headers = {GENERATION_ID_HEADER: ",".join(c.generation_id for c in result.choices)}
    if result.recorded is not None:
        headers[RECORDED_HEADER] = "true" if result.recorded else "false"
    return headers


def create_app(api: OpenAIApi) -> FastAPI:
    """The FastAPI app over `api`."""
    app = FastAPI(title="rlpipe serve mode (OpenAI-compatible)", description=__doc__)

    @app.get("/v1/models", summary="The served model")
    async def models(request: Request) -> Response:
        async def reply(_: Any, __: str) -> Reply:
            return api.models(), {}

        return await _handle(request, "models", api, reply, read_body=False)

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI subset)")
    async def chat(request: Request) -> Response:
        return await _handle(request, "chat", api, api.chat)

    @app.post("/v1/completions", summary="Legacy completion (OpenAI subset)")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completions", api, api.completions)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = ApiError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code="not_found" if exc.status_code == 404 else None,
        )
        return _json(error.status, error.body())

    return app


async def _handle(
    request: Request,
    route: str,
    api: OpenAIApi,
    reply: Callable[[Any, str], Coroutine[Any, Any, Reply]],
    read_body: bool = True,
) -> Response:
    started = time.perf_counter()
    try:
        key = api.authorize(request.headers.get("authorization"))
        if read_body:  # a generation: refused before its body is decoded when full
            api.admission.check_open(key)
        body = await _read_json(request, api.config.max_body_bytes) if read_body else None
        content, headers = await api.unless_disconnected(request, reply(body, key))
        response = _json(200, content, headers)
    except ApiError as exc:
        retry = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        response = _json(exc.status, exc.body(), retry)
    except ClientDisconnect:  # nobody to answer: the work is cancelled, nothing recorded
        response = Response(status_code=CLIENT_CLOSED)
    except Exception:  # deliberate: our own failure is a 500 in OpenAI's shape, and logged
        log.exception("serve-mode request failed", route=route)
        error = ApiError(500, "internal error while serving the request", type="server_error")
        response = _json(500, error.body())
    REQUESTS.labels(route, str(response.status_code)).inc()
    REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
    return response


async def _disconnect(request: Request) -> None:
    """Returns when the client is gone (the body has been read: only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"body over {limit} bytes")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from exc


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )
