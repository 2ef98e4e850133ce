"""OpenAI response bodies for served results: chat, legacy completions, models, logprobs.

Besides OpenAI's fields, each choice carries `generation_id` (what feedback names),
`policy_version`, and the rollout contract's `rl_policy` (the versions it started and ended
on, by number and hash; libs.serve.contract); with `return_token_ids` (as recent vLLM) the
body has `prompt_token_ids` and each choice `token_ids`: exactly the ids the engine
sampled, the stop token included (the text drops it and anything from a stop string on).
Logprobs cover every one of those ids, so `len(logprobs) == len(token_ids)` always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.rollout.version_book import VersionBook
from libs.serve.contract import statement
from libs.serve.generation import ServedChoice, ServedResult
from libs.serve.protocol import LogprobsMode
from libs.tokenizer import NUM_BYTES, ByteTokenizer, Tokenizer


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a special token: its name)."""
    if isinstance(tokenizer, ByteTokenizer) and 0 <= token_id < NUM_BYTES:
        return bytes([token_id])  # decoding one byte of a multi-byte character would lose it
    return tokenizer.decode([token_id], skip_special=False).encode()


def _reported_logprobs(choice: ServedChoice, mode: LogprobsMode) -> list[float]:
    completion = choice.completion
    return completion.raw_logprobs if mode == "raw_logprobs" else completion.logprobs


def chat_logprobs(tokenizer: Tokenizer, choice: ServedChoice, mode: LogprobsMode) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion; `top_logprobs` always empty."""
    content = []
    for token_id, logprob in zip(
        choice.completion.token_ids, _reported_logprobs(choice, mode), strict=True
    ):
        raw = token_bytes(tokenizer, token_id)
        content.append(
            {
                "token": raw.decode("utf-8", errors="replace"),
                "logprob": logprob,
                "bytes": list(raw),
                "top_logprobs": [],
            }
        )
    return {"content": content, "refusal": None}


def legacy_logprobs(
    tokenizer: Tokenizer, choice: ServedChoice, mode: LogprobsMode
) -> dict[str, Any]:
    """`choices[].logprobs` of a legacy completion: tokens, their logprobs and offsets."""
    tokens = [
        token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
        for token_id in choice.completion.token_ids
    ]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": _reported_logprobs(choice, mode),
        "text_offset": offsets,
        "top_logprobs": [{} for _ in tokens],
    }


def usage(prompt_ids: list[int], result: ServedResult) -> dict[str, int]:
    completion_tokens = sum(len(c.completion.token_ids) for c in result.choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt_ids) + completion_tokens,
    }


@dataclass(frozen=True)
class BodyOptions:
    """What a response body shows, from the request."""

    model: str
    prompt_ids: list[int]
    tokenizer: Tokenizer
    logprobs: bool
    logprobs_mode: LogprobsMode
    return_token_ids: bool
    versions: VersionBook
    """Names each choice's versions (number and hash)."""
    raw_logprobs: bool = False
    """The contract's `return_raw_logprobs`: raw logprobs in each choice's `rl_policy`."""


def chat_completion_body(result: ServedResult, options: BodyOptions) -> dict[str, Any]:
    """A `chat.completion` object."""
    choices = [
        {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": (
                chat_logprobs(options.tokenizer, choice, options.logprobs_mode)
                if options.logprobs
                else None
            ),
            "finish_reason": choice.completion.finish_reason,
            **_choice_extras(choice, options),
        }
        for choice in result.choices
    ]
    return _body(result, "chat.completion", choices, options)


def completion_body(result: ServedResult, options: BodyOptions) -> dict[str, Any]:
    """A legacy `text_completion` object."""
    choices = [
        {
            "index": choice.index,
            "text": choice.text,
            "logprobs": (
                legacy_logprobs(options.tokenizer, choice, options.logprobs_mode)
                if options.logprobs
                else None
            ),
            "finish_reason": choice.completion.finish_reason,
            **_choice_extras(choice, options),
        }
        for choice in result.choices
    ]
    return _body(result, "text_completion", choices, options)


def _choice_extras(choice: ServedChoice, options: BodyOptions) -> dict[str, Any]:
    extras: dict[str, Any] = {
        "generation_id": choice.generation_id,
        "policy_version": choice.completion.policy_version,
        "rl_policy": statement(
            choice.completion, options.versions, options.logprobs_mode, raw=options.raw_logprobs
        ),
    }
    if options.return_token_ids:
        extras["token_ids"] = choice.completion.token_ids
    return extras


def _body(
    result: ServedResult, kind: str, choices: list[dict[str, Any]], options: BodyOptions
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": result.response_id,
        "object": kind,
        "created": result.created,
        "model": options.model,
        "choices": choices,
        "usage": usage(options.prompt_ids, result),
    }
    if options.return_token_ids:
        body["prompt_token_ids"] = options.prompt_ids
    return body


def models_body(model: str, created: int, policy_version: int | None) -> dict[str, Any]:
    """`GET /v1/models`: the one model served, with the policy version it runs now."""
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "rlpipe",
                "policy_version": policy_version,
            }
        ],
    }
