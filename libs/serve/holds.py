"""A served request's completions decoded in holds of at most `hold_tokens` steps each.

The engine is shared with rollouts and weight swaps, and one engine call runs to its end: a
request of n=16 x 8,000 tokens decoded as one call would hold the engine for minutes. So a
served request is decoded as a sequence of calls of at most `hold_tokens` new tokens each;
between two calls the batcher lets rollouts and weight swaps go first, a disconnected
client's request is dropped (its task is cancelled), and a stopping worker ends within one
hold. A call continues each row that has not finished from its prompt plus the tokens it has
so far (an engine with prefix sharing computes little of that again):

    completions = await generate_in_holds(batcher.generate_served, prompt_ids, 16, params,
                                          hold_tokens=8, tokenizer=tokenizer)

What the caller gets is what one call would give up to sampling: per-token sampling logprobs
of the weights that drew each token, `finish_reason` "stop" when eos, a stop id or a stop
string ended the row (a stop string that spans two holds is found here, where the engine saw
only its own hold's tokens), else "length". A seeded request samples what one call with its
seed would where the engine continues a hold's sampling RNG with its KV (the hf engine's
continuation cache); elsewhere hold k draws with a seed derived from (seed, k), reproducible
too. `policy_version` is the version the first token came from; `policy_version_end` the
last one's when a weight swap fell between two holds or inside one, and `version_switches`
the token each version started at (proto.version_switches): a hold's own switches and one
at the hold's first token when the swap fell between holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from libs.engine.base import Completion, FinishReason, SamplingParams
from libs.engine.requests import hits_stop
from libs.moe.routing import extend_routing
from libs.tokenizer import Tokenizer
from proto.version_switches import cut_switches

GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]

_SEED_STEP = 0x9E3779B97F4A7C15  # golden-ratio increment: hold seeds far apart
_MAX_SEED = 2**63 - 1


@dataclass
class _Row:
    """One choice being decoded across holds."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_version: int | None = None
    last_version: int = 0
    switches: list[tuple[int, int]] = field(default_factory=list)
    switches_known: bool = True  # False: a hold spanned a swap without saying where
    routing: torch.Tensor | None = None  # MoE: [prompt + tokens - 1, L, k] so far


async def generate_in_holds(
    generate: GenerateFn,
    prompt_ids: list[int],
    num_choices: int,
    params: SamplingParams,
    *,
    hold_tokens: int,
    tokenizer: Tokenizer,
) -> list[Completion]:
    """`num_choices` completions of `prompt_ids`, decoded `hold_tokens` steps per call."""
    if hold_tokens < 1:
        raise ValueError(f"hold_tokens must be >= 1, got {hold_tokens}")
    rows = [_Row() for _ in range(num_choices)]
    hold = 0
    while live := [row for row in rows if row.finish_reason is None]:
        done = len(live[0].token_ids)  # rows still running have all decoded as many
        steps = min(hold_tokens, params.max_tokens - done)
        prompts = [[*prompt_ids, *row.token_ids] for row in live]
        completions = await generate(prompts, _hold_params(params, steps, hold))
        for row, completion in zip(live, completions, strict=True):
            _extend(row, completion, params, tokenizer)
            if row.finish_reason is None and len(row.token_ids) >= params.max_tokens:
                row.finish_reason = "length"
        hold += 1
    return [_completion(index, row) for index, row in enumerate(rows)]


def _hold_params(params: SamplingParams, steps: int, hold: int) -> SamplingParams:
    seed = params.seed
    if seed is not None and hold:
        seed = (seed + hold * _SEED_STEP) % _MAX_SEED
    return dataclasses.replace(params, max_tokens=steps, seed=seed)


def _extend(
    row: _Row,
    completion: Completion,
    params: SamplingParams,
    tokenizer: Tokenizer,
) -> None:
    """Append one hold's tokens to `row`, cut at a stop string that spans the two holds."""
    before = len(row.token_ids)
    row.token_ids += completion.token_ids
    row.logprobs += completion.logprobs
    row.raw_logprobs += completion.raw_logprobs
    row.routing = extend_routing(row.routing, completion.routed_experts)
    _extend_versions(row, completion, before)
    if completion.finish_reason == "stop":
        row.finish_reason = "stop"
    cut = _spanning_stop(row.token_ids, before, len(completion.token_ids), params, tokenizer)
    if cut is not None:
        if row.routing is not None:  # the positions fed after the stop's last token go too
            row.routing = row.routing[: row.routing.shape[0] - (len(row.token_ids) - cut)]
        del row.token_ids[cut:], row.logprobs[cut:], row.raw_logprobs[cut:]
        row.switches = list(cut_switches(row.switches, cut))
        row.finish_reason = "stop"


def _extend_versions(row: _Row, completion: Completion, before: int) -> None:
    """The versions of a hold's tokens, appended at token `before`: a switch at its first
    token when a swap fell between the holds, then the hold's own switches."""
    if row.first_version is None:
        row.first_version = completion.policy_version
    elif completion.token_ids and completion.policy_version != row.last_version:
        row.switches.append((before, completion.policy_version))
    row.switches += [(before + index, version) for index, version in completion.version_switches]
    end = completion.policy_version_end
    row.switches_known &= end is None or bool(completion.version_switches)
    row.last_version = completion.policy_version if end is None else end


def _spanning_stop(
    token_ids: list[int], before: int, added: int, params: SamplingParams, tokenizer: Tokenizer
) -> int | None:
    """Where a stop string that began before this hold's tokens ends, if one does: the
    engine looked only at the tokens of its own hold."""
    if not before or not params.stop_strings:
        return None
    # A stop string of n UTF-8 bytes spans at most n tokens: only the first n - 1 tokens of
    # the hold can end one that began earlier.
    reach = max(len(text.encode()) for text in params.stop_strings) - 1
    no_ids = dataclasses.replace(params, stop_token_ids=())
    for end in range(before + 1, before + min(reach, added) + 1):
        if hits_stop(token_ids[:end], no_ids, tokenizer):
            return end
    return None


def _completion(index: int, row: _Row) -> Completion:
    first, last = row.first_version, row.last_version
    assert row.finish_reason is not None and first is not None, "every row decoded a hold"
    switches = tuple(row.switches) if row.switches_known else ()
    if switches:  # the last token's version (a stop string's cut may have dropped a switch)
        last = switches[-1][1]
    elif row.switches_known:
        last = first
    return Completion(
        prompt_index=0,
        sample_index=index,
        token_ids=row.token_ids,
        logprobs=row.logprobs,
        raw_logprobs=row.raw_logprobs,
        finish_reason=row.finish_reason,
        policy_version=first,
        policy_version_end=last if last != first else None,
        version_switches=switches,
        routed_experts=row.routing,
    )
