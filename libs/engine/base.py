"""The inference-engine interface every backend implements, and its value types.

An engine turns token-id prompts into sampled completions and records, for each sampled
token, its logprob under the distribution it was actually drawn from: that is the behavior
policy the trainer corrects against. It also takes new weights in place and says which
policy version produced each completion.

Methods are synchronous and blocking; the asyncio services run them in a worker thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

FinishReason = Literal["stop", "length"]
T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions.

    `temperature` 0 means greedy decoding (argmax); its sampling distribution is then a
    point mass, so recorded sampling logprobs are 0.0 (raw logprobs stay informative).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus: sample only from the smallest set of top tokens whose mass reaches top_p."""
    max_tokens: int = 64
    """Most tokens generated per completion, stop token included."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a completion (the tokenizer's eos always does); kept in the output."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end a completion once its decoded text contains one; tokens are kept
    through the one that completed the string (the trainer trains on token ids)."""
    seed: int | None = None
    """Seed of the sampling RNG for this call; None draws fresh randomness."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not text for text in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax instead of sampling."""
        return self.temperature == 0


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """Index within the prompt's group of `num_samples` (the GRPO group)."""
    token_ids: list[int]
    """Generated ids, the stop token included when one ended the completion."""
    logprobs: list[float]
    """Per token: logprob under the sampling distribution (after temperature and top-p)."""
    raw_logprobs: list[float]
    """Per token: logprob under the model's plain softmax (temperature 1, no top-p);
    compare with the trainer's recomputed logprobs to measure train/inference mismatch."""
    finish_reason: FinishReason
    policy_version: int
    """Version of the weights the completion started on (that produced its first token)."""
    policy_version_end: int | None = None
    """Version the completion ended on, when the weights changed between its decode steps
    (engines that `swap_between_steps`); None: `policy_version` produced every token."""
    version_switches: tuple[tuple[int, int], ...] = ()
    """Which version sampled which token: (index of the first token sampled with a version,
    that version) for every change from `policy_version`, in token order; the last one's
    version is `policy_version_end`. Index 0 when a newer version than `policy_version`
    already sampled the first token (a call queued during a swap). Empty when one version
    sampled every token, and from engines that swap only between calls."""
    policy_version_hash: str = ""
    """Target hash of the signed manifest of `policy_version` (proto.rollout_contract); empty
    where the engine cannot name it (a local engine knows numbers only: the worker fills it
    from the versions it applied, libs.rollout.version_book)."""
    policy_version_end_hash: str = ""
    """The same for `policy_version_end` (empty when that is None)."""
    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts routing: a CPU tensor [P + G - 1, L, k] (uint8 when the model has
    at most 256 experts, else int16) of the experts each of the L MoE layers chose (top-k)
    at each position of prompt + completion that was fed through the model (the last
    sampled token never is); positions whose KV came from a reused prefix carry the routing
    recorded when that prefix was computed. None for dense models (libs.moe.routing)."""


@dataclass(frozen=True)
class ContinuationScores:
    """Logprobs of given continuations of given prompts (nothing sampled)."""

    logprobs: list[list[float]]
    """Per continuation, per token: logprob under the model's plain softmax (temperature 1,
    no top-p) given its prompt and the continuation's tokens before it."""
    policy_version: int
    """Version of the weights that scored every continuation."""


class InferenceEngine(abc.ABC):
    """A backend that samples completions and hot-swaps its weights."""

    @property
    def max_context_tokens(self) -> int | None:
        """Most tokens (prompt + completion) one sequence may hold; None when unknown."""
        return None

    @property
    def continuous_batching(self) -> bool:
        """True when concurrent `generate` calls share one running batch (so a caller should
        hand each request over as it comes instead of merging requests into one call)."""
        return False

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently loaded."""

    @abc.abstractmethod
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[Completion]:
        """`num_samples` completions per prompt, ordered by (prompt_index, sample_index)."""

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> Future[list[Completion]]:
        """`generate` without waiting: the call's future, resolved from the engine's own
        thread when its completions are done (engines with continuous batching, whose
        callers hand each request over as it comes; an asyncio caller awaits
        `asyncio.wrap_future(engine.submit(...))` and no thread waits per call)."""
        raise NotImplementedError(f"{type(self).__name__} takes calls through generate only")

    @abc.abstractmethod
    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy `state` into the live parameters in place, set `version`; return the pause in s.

        `state` maps parameter names to tensors and may hold a subset of them (a delta that
        leaves some tensors unchanged). A call never interleaves with a `generate` call, so
        every completion comes from exactly one version.
        """

    def restore_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """`update_weights`, where `version` may be older than the one loaded: a serve
        replica lent to RL goes back to its promoted version (libs/fleet/lending.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore an older version")

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        """The model's own weight tensors by name, on its device, sharing storage with its
        parameters (tied weights under every name), to be written in place only inside
        `write_in_place`; None when the engine cannot expose them (weights in another
        process): then hand new weights over with `update_weights`."""
        return None

    def write_in_place(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        """Run `write` (which changes the `live_tensors()` in place) while no `generate` runs,
        then report `version`; returns what `write` returned and the pause in seconds. If
        `write` raises, the version stays as it was (and the weights are whatever it left)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be written in place")

    @property
    def swaps_between_steps(self) -> bool:
        """True when `write_between_steps` can swap weights under running calls."""
        return False

    def write_between_steps(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        """As `write_in_place`, but between two decode steps, without waiting for the running
        calls: they go on with the new weights (their KV so far stays the old weights'), and
        their completions report the version they ended on (`policy_version_end`), so a long
        generation does not pin an old policy. Per-token logprobs stay those of the weights
        that sampled each token."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap weights between steps")

    def score(self, prompts: list[list[int]], continuations: list[list[int]]) -> ContinuationScores:
        """Logprobs of `continuations[i]` after `prompts[i]`, token by token (optional: serve
        mode's constrained choice needs it). Never interleaves with a weight update."""
        raise NotImplementedError(f"{type(self).__name__} cannot score continuations")
