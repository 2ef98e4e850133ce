"""Request bodies of the OpenAI-compatible API, and the error every refusal is answered with.

The OpenAI subset the engine can honour, plus the extras vLLM and SGLang accept in the body
(the official client sends them through `extra_body`):

- `return_token_ids` (bool): the prompt's and each choice's token ids in the response;
- `guided_choice` (legacy vLLM) or `structured_outputs: {"choice": [...]}`: answer with
  exactly one of the given strings;
- `stop_token_ids`: ids that end a completion besides the tokenizer's eos;
- `logprobs_mode`: `processed_logprobs` (default: under the distribution actually sampled
  from, after temperature and top-p; what the trainer corrects against) or `raw_logprobs`
  (the model's plain softmax, vLLM's default);
- `training_eligible` (bool, default true): whether the generation's record may become a
  training sample when feedback arrives for it;
- `rl_policy`: the rollout contract's version requirement (proto.rollout_contract, checked
  by libs.serve.contract).

Parameters the engine cannot honour (streaming, penalties, logit bias, alternatives in
`top_logprobs`, JSON/regex/grammar constraints, tools) are refused with a 400 that names
the field, never silently ignored. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_SEED = 2**63 - 1
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class ApiError(Exception):
    """A refused request, answered as OpenAI does: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        """Sent as `Retry-After` (429, 503): when the caller may try again."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a field the caller got wrong."""
    return ApiError(400, message, param=param, code=code)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: only `choice` is supported."""

    model_config = ConfigDict(extra="allow")

    choice: list[str] | None = None


class TextPart(BaseModel):
    """One part of a message's content given as a list; only text parts are supported."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One message of the conversation; `developer` is read as `system`."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class CommonRequest(BaseModel):
    """Fields shared by chat and legacy completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    training_eligible: bool = True
    return_token_ids: bool = False
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    logprobs_mode: LogprobsMode = "processed_logprobs"
    rl_policy: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not text for text in stops):
            raise invalid("stop must not contain an empty string", "stop")
        return tuple(stops)

    def choices(self) -> list[str] | None:
        """The strings a constrained choice picks from, or None when unconstrained."""
        structured = self.structured_outputs
        if structured is not None:
            others = sorted(k for k, v in (structured.model_extra or {}).items() if v is not None)
            if others:
                raise invalid(
                    f"structured_outputs.{others[0]} is not supported: only `choice` is",
                    f"structured_outputs.{others[0]}",
                )
        choices = structured.choice if structured and structured.choice is not None else None
        # Clients that target several vLLM versions send both spellings: fine when they agree.
        if choices is not None and self.guided_choice is not None and choices != self.guided_choice:
            raise invalid(
                "guided_choice and structured_outputs.choice differ: give one list",
                "guided_choice",
            )
        choices = self.guided_choice if choices is None else choices
        if choices is not None and not choices:
            raise invalid("the choice list is empty: give at least one string", "guided_choice")
        return choices

    def check_supported(self) -> None:
        """400 naming the first parameter the engine cannot honour."""
        if self.stream:
            raise invalid("stream=true is not supported: request the whole response", "stream")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise invalid(f"{param} is not supported: leave it at 0", param)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid(
                "response_format other than text is not supported; for a fixed set of "
                "answers use structured_outputs.choice",
                "response_format",
            )


class ChatRequest(CommonRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise invalid(
                "top_logprobs > 0 is not supported: the engine records only the sampled "
                "token's logprob; use logprobs=true with top_logprobs 0 or unset",
                "top_logprobs",
            )
        if self.tools:
            raise invalid("tools are not supported by serve mode yet", "tools")
        for index, message in enumerate(self.messages):
            if message.tool_calls:
                raise invalid(
                    "assistant tool_calls are not supported by serve mode yet",
                    f"messages.{index}.tool_calls",
                )


class CompletionRequest(CommonRequest):
    """POST /v1/completions (legacy): one prompt, as text or as token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.prompt:
            raise invalid("prompt is empty", "prompt")
        if self.logprobs:
            raise invalid(
                "logprobs > 0 (alternatives per position) is not supported: the engine "
                "records only the sampled token's logprob; use logprobs=0",
                "logprobs",
            )
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")


R = TypeVar("R", bound=CommonRequest)


def parse_request(model: type[R], body: Any) -> R:
    """`body` (decoded JSON) as `model`; a 400 naming the first failing field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise invalid(f"{param}: {first['msg']}" if param else first["msg"], param) from exc
    request.check_supported()
    return request
