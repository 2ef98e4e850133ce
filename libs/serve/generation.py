"""`ServedPolicy`: what serve mode does with a request, apart from HTTP.

Prompt ids in; `n` completions out, either sampled by the engine (through the rollout
worker's `GenerationBatcher`, in holds of at most `hold_tokens` decode steps so rollouts
and weight swaps get the engine between two: libs.serve.holds) or picked among given
strings (`libs.serve.choice`, scored through the batcher too); each completion gets a
generation id and is recorded as a `ServedGeneration` before the caller sees it:

    served = ServedPolicy(batcher.generate_served, tokenizer, score=batcher.score,
                          recorder=recorder, hold_tokens=8)
    result = await served.serve(GenerationRequest(prompt_ids, SamplingParams(), 1, "cmpl"))

Generation ids: the response id (`chatcmpl-<32 hex>`, `cmpl-<32 hex>`) when one choice is
asked for, else `<response id>-<choice index>`. They fit the feedback API's id rule
(letters, digits, '-', '_'), so the product posts feedback with the id it received.

Recorded logprobs are the sampling logprobs (under the distribution each token was drawn
from: temperature and top-p applied; 0.0 at temperature 0), and the recorded version is the
one the first token came from (a weight swap between two holds moves the later tokens to
a newer version: their logprobs are that version's). A constrained choice records
its tokens' plain-softmax logprobs and `metadata["rlpipe_constraint"] = "choice"`, since no
per-token sampling happened.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from libs.engine.base import Completion, ContinuationScores, SamplingParams
from libs.moe.wire import encode_routing
from libs.serve.choice import pick_choices
from libs.serve.holds import generate_in_holds
from libs.serve.protocol import invalid
from libs.serve.records import GenerationRecorder
from libs.tokenizer import Tokenizer
from proto.messages import SamplingSettings, ServedGeneration
from proto.moe import RoutedExperts

GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]
ScoreFn = Callable[[list[list[int]], list[list[int]]], Awaitable[ContinuationScores]]

CONSTRAINT_KEY = "rlpipe_constraint"


@dataclass(frozen=True)
class GenerationRequest:
    """One API request, as token ids and engine parameters."""

    prompt_ids: list[int]
    params: SamplingParams
    num_choices: int
    id_prefix: str
    """`chatcmpl` or `cmpl`: the response id's prefix, as OpenAI names them."""
    choices: list[str] | None = None
    """Constrained choice: answer with one of these strings; None samples freely."""
    choice_end_ids: tuple[int, ...] = ()
    """Ids that follow every choice's text (the turn's stop id): scored, and returned."""
    metadata: dict[str, str] = field(default_factory=dict)
    training_eligible: bool = True
    accept: Callable[[list[Completion]], None] | None = None
    """Called with the completions before they are recorded: raising (an ApiError) refuses
    the request and records nothing (the rollout contract's exact version, broken by a swap)."""


@dataclass(frozen=True)
class ServedChoice:
    """One choice of a response."""

    index: int
    generation_id: str
    completion: Completion
    text: str
    """What the caller sees: special tokens dropped, cut before a stop string."""


@dataclass(frozen=True)
class ServedResult:
    """Every choice of one request, and whether they were recorded (None: recording off)."""

    response_id: str
    created: int
    choices: list[ServedChoice]
    recorded: bool | None


class ServedPolicy:
    """Generates or chooses, names each completion, records it; see the module docstring."""

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: Tokenizer,
        *,
        score: ScoreFn | None = None,
        recorder: GenerationRecorder | None = None,
        hold_tokens: int = 8,
        max_context_tokens: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.score = score
        self.recorder = recorder
        self.hold_tokens = hold_tokens
        self.max_context_tokens = max_context_tokens
        self._clock = clock

    async def serve(self, request: GenerationRequest) -> ServedResult:
        """The request's choices, recorded; ApiError (400) when the engine refuses it."""
        try:
            if request.choices is None:
                completions = await self._sample(request)
            else:
                completions = await self._choose(request, request.choices)
        except ValueError as exc:  # the engine names what it cannot serve
            raise invalid(str(exc)) from exc
        if request.accept is not None:
            request.accept(completions)
        now = self._clock()
        response_id = f"{request.id_prefix}-{uuid.uuid4().hex}"
        choices = [
            ServedChoice(
                index=index,
                generation_id=response_id if len(completions) == 1 else f"{response_id}-{index}",
                completion=completion,
                text=self._text(request, completion),
            )
            for index, completion in enumerate(completions)
        ]
        recorded = None
        if self.recorder is not None:
            recorded = await self.recorder.record([_record(request, c, now) for c in choices])
        return ServedResult(response_id, int(now), choices, recorded)

    async def _sample(self, request: GenerationRequest) -> list[Completion]:
        limit, wanted = self.max_context_tokens, len(request.prompt_ids) + request.params.max_tokens
        if limit is not None and wanted > limit:  # refused before the first hold, not mid-way
            raise invalid(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) exceeds the model's {limit} tokens; lower "
                "max_tokens or shorten the prompt",
                "max_tokens",
            )
        return await generate_in_holds(
            self.generate,
            request.prompt_ids,
            request.num_choices,
            request.params,
            hold_tokens=self.hold_tokens,
            tokenizer=self.tokenizer,
        )

    async def _choose(self, request: GenerationRequest, choices: list[str]) -> list[Completion]:
        """`num_choices` picks among `choices`, as completions of the picked token ids."""
        if self.score is None:
            raise invalid("this engine cannot score choices: constrained choice is unavailable")
        sequences = [[*self.tokenizer.encode(text), *request.choice_end_ids] for text in choices]
        if any(not sequence for sequence in sequences):
            raise invalid("a choice is empty and the turn has no end id to score", "choice")
        try:
            scores = await self.score([request.prompt_ids] * len(choices), sequences)
        except NotImplementedError as exc:
            raise invalid(f"constrained choice is unavailable: {exc}") from exc
        totals = [sum(logprobs) for logprobs in scores.logprobs]
        picks = pick_choices(
            totals, request.params.temperature, request.num_choices, request.params.seed
        )
        return [
            Completion(
                prompt_index=0,
                sample_index=index,
                token_ids=sequences[pick],
                logprobs=scores.logprobs[pick],
                raw_logprobs=scores.logprobs[pick],
                finish_reason="stop",
                policy_version=scores.policy_version,
            )
            for index, pick in enumerate(picks)
        ]

    def _text(self, request: GenerationRequest, completion: Completion) -> str:
        text = self.tokenizer.decode(completion.token_ids)
        if completion.finish_reason != "stop" or not request.params.stop_strings:
            return text
        ends = [text.find(stop) for stop in request.params.stop_strings if stop in text]
        return text[: min(ends)] if ends else text


def _routing(routed: torch.Tensor | None) -> RoutedExperts | None:
    """An MoE completion's routing of prompt + completion, for router replay on feedback."""
    return None if routed is None else encode_routing(routed)


def _record(request: GenerationRequest, choice: ServedChoice, now: float) -> ServedGeneration:
    params = request.params
    metadata = dict(request.metadata)
    if request.choices is not None:
        metadata[CONSTRAINT_KEY] = "choice"
    return ServedGeneration(
        generation_id=choice.generation_id,
        policy_version=choice.completion.policy_version,
        prompt_token_ids=request.prompt_ids,
        completion_token_ids=choice.completion.token_ids,
        logprobs=choice.completion.logprobs,
        sampling=SamplingSettings(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=list(params.stop_strings),
            stop_token_ids=list(params.stop_token_ids),
            seed=params.seed,
        ),
        metadata=metadata,
        # A constrained choice was picked among whole sequences, not sampled token by token:
        # its logprobs are no behavior policy to correct against, so it never trains.
        training_eligible=request.training_eligible and request.choices is None,
        created_at=now,
        routed_experts=_routing(choice.completion.routed_experts),
        policy_version_end=choice.completion.policy_version_end,
        version_switches=tuple(choice.completion.version_switches),
    )
