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
body the API cannot serve (bad JSON, a bad or unsupported field, named in `param`), 401
without the configured key (`Authorization: Bearer <key>`), 404 for another model name,
413 for a body over the limit, 503 while the worker has no weights yet (Retry-After), and
500 only for our own failures.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.chat.template import ChatTemplate
from libs.engine.base import SamplingParams
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

Reply = tuple[dict[str, Any], dict[str, str]]


class ServeConfig(BaseModel):
    """Where the OpenAI-compatible API listens, what it serves and accepts (the
    rollout-worker's `serve`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int = Field(
        0, ge=0, le=65535, description="Port of the OpenAI-compatible API; 0: serve mode off"
    )
    host: str = Field("127.0.0.1", description="Address the OpenAI-compatible API binds")
    model_name: str = Field(
        "rlpipe-policy", min_length=1, description="Model name the API serves (`model` field)"
    )
    api_key: str | None = Field(
        None, description="Secret required as `Authorization: Bearer <key>`; unset: open"
    )
    max_choices: int = Field(16, ge=1, description="Largest `n` of one request")
    default_max_tokens: int = Field(
        256, ge=1, description="Chat completion tokens when a request sets no max"
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body")
    not_ready_retry_after_s: int = Field(
        1, ge=0, description="Retry-After of a 503 while no weights are loaded"
    )


class OpenAIApi:
    """What the routes do apart from HTTP: check, render, serve, shape the answer."""

    def __init__(
        self,
        served: ServedPolicy,
        template: ChatTemplate,
        policy_version: Callable[[], int | None],
        config: ServeConfig,
    ) -> None:
        self.served = served
        self.template = template
        self.policy_version = policy_version
        self.config = config
        self.started = int(time.time())

    def authorize(self, authorization: str | None) -> None:
        expected = self.config.api_key
        if not expected:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), expected):
            raise ApiError(
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )

    def models(self) -> dict[str, Any]:
        return models_body(self.config.model_name, self.started, self.policy_version())

    async def chat(self, body: Any) -> Reply:
        request = parse_request(ChatRequest, body)
        self._admit(request)
        messages = [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
            for m in request.messages
        ]
        prompt_ids = self.template.render(messages)
        max_tokens = (
            request.max_completion_tokens or request.max_tokens or self.config.default_max_tokens
        )
        stop_ids = self.template.stop_token_ids
        params = _sampling_params(request, max_tokens, stop_ids)
        result = await self.served.serve(
            _generation(request, prompt_ids, params, "chatcmpl", stop_ids[:1])
        )
        options = self._options(request, prompt_ids, request.logprobs)
        return chat_completion_body(result, options), _headers(result)

    async def completions(self, body: Any) -> Reply:
        request = parse_request(CompletionRequest, body)
        self._admit(request)
        prompt = request.prompt
        prompt_ids = self.served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not prompt_ids:
            raise invalid("prompt has no tokens", "prompt")
        params = _sampling_params(request, request.max_tokens or LEGACY_DEFAULT_MAX_TOKENS, ())
        eos = (self.served.tokenizer.eos_id,)
        result = await self.served.serve(_generation(request, prompt_ids, params, "cmpl", eos))
        options = self._options(request, prompt_ids, request.logprobs is not None)
        return completion_body(result, options), _headers(result)

    def _admit(self, request: CommonRequest) -> None:
        """404 for another model, 400 for too many choices, 503 without weights."""
        name = self.config.model_name
        if request.model is not None and request.model != name:
            raise ApiError(
                404,
                f"model {request.model!r} is not served here; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        if request.n > self.config.max_choices:
            raise invalid(f"n must be <= {self.config.max_choices}, got {request.n}", "n")
        if self.policy_version() is None:
            raise ApiError(
                503,
                "the model has no weights yet (the worker waits for the first version); retry",
                type="server_error",
                code="model_not_ready",
            )

    def _options(
        self, request: CommonRequest, prompt_ids: list[int], logprobs: bool
    ) -> BodyOptions:
        return BodyOptions(
            model=self.config.model_name,
            prompt_ids=prompt_ids,
            tokenizer=self.served.tokenizer,
            logprobs=logprobs,
            logprobs_mode=request.logprobs_mode,
            return_token_ids=request.return_token_ids,
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
        async def reply(_: Any) -> Reply:
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
    reply: Callable[[Any], Awaitable[Reply]],
    read_body: bool = True,
) -> Response:
    started = time.perf_counter()
    try:
        api.authorize(request.headers.get("authorization"))
        body = await _read_json(request, api.config.max_body_bytes) if read_body else None
        content, headers = await reply(body)
        response = _json(200, content, headers)
    except ApiError as exc:
        headers = {}
        if exc.status == 503:
            headers["Retry-After"] = str(api.config.not_ready_retry_after_s)
        response = _json(exc.status, exc.body(), headers)
    except Exception:  # deliberate: our own failure is a 500 in OpenAI's shape, and logged
        log.exception("serve-mode request failed", route=route)
        error = ApiError(500, "internal error while serving the request", type="server_error")
        response = _json(500, error.body())
    REQUESTS.labels(route, str(response.status_code)).inc()
    REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
    return response


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
