"""The `hf` engine: batched sampling with a KV cache on a torch/transformers model.

The embedded default backend (CPU or GPU). Its own decoding loop instead of
`model.generate`, so every sampled token's logprob is recorded under exactly the
distribution it was drawn from (see `libs.engine.sampling`):

    tokenizer = ByteTokenizer()
    engine = HFEngine(build_policy(PolicyConfig()), tokenizer)
    completions = engine.generate([tokenizer.encode("2+2=")], SamplingParams(max_tokens=8), 4)

How a batch runs: prompts are repeated `num_samples` times (a GRPO group), left-padded,
prefilled once into a `DynamicCache`, then decoded one token per step. Rows that finish
are dropped from the batch and its cache, so long stragglers do not make finished rows
cost compute. Position ids count only real tokens, so padding does not shift RoPE and a
row decodes the same alone or in a batch (up to float rounding). Rows a call cuts at
`max_tokens` keep their KV cache for a call that continues exactly them
(`libs.engine.continuations`: serve mode's holds), across weight swaps too.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from libs.engine.base import (
    Completion,
    ContinuationScores,
    FinishReason,
    InferenceEngine,
    SamplingParams,
    T,
)
from libs.engine.continuations import ContinuationCache
from libs.engine.requests import check_request, check_version, hits_stop, stage_update
from libs.engine.sampling import SampledTokens, make_generator, sample_next_tokens
from libs.moe.routing import RoutingRecorder, moe_shape, record_routing
from libs.policy import position_ids_from_mask, sequence_logprobs
from libs.tokenizer import Tokenizer

# Attention kernels allowed while decoding: all but cuDNN's, which builds a graph for every
# new (batch, length) shape, and decoding makes a new shape every step (3x slower with it).
DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CONTINUATION_CACHE_TOKENS = 131_072
"""Tokens of suspended rows' KV kept for their continuation: serve mode's 4 running requests
of 16 rows x 2,048 tokens (the tiny preset's fp32 KV: 2 KiB a token, 256 MiB in all)."""


@dataclass
class _Row:
    """One completion being generated."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    routing: list[torch.Tensor] = field(default_factory=list)
    """MoE routing of the positions fed so far, in pieces [n, L, k] (empty: dense model)."""


@dataclass
class _Batch:
    """Decoding state of the rows still running; slot i of every tensor is row `live[i]`."""

    live: list[int]
    attention_mask: torch.Tensor  # [B, prompt + generated so far], 0 on left padding
    cache: DynamicCache


@dataclass
class _Suspended:
    """Rows cut by max_tokens: their cache holds all but `last_ids` [B], not fed yet; the
    sampling RNG goes on from where it was, so a seeded call continued in holds samples what
    one call would."""

    batch: _Batch
    last_ids: torch.Tensor
    generator: torch.Generator
    routing: list[list[torch.Tensor]] = field(default_factory=list)
    """Per row, the MoE routing of its positions already in the cache (empty: dense)."""


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as left-padded `input_ids` and `attention_mask`, both [B, longest prompt]."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


class HFEngine(InferenceEngine):
    """`InferenceEngine` running a transformers causal LM in this process."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        max_batch_rows: int = 64,
        policy_version: int = 0,
        *,
        record_routing: bool = True,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._version = policy_version
        # Every name a weight update may address; tied weights appear under both names.
        self._tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        # Held for a whole generate call and for the copy of an update: no completion
        # mixes two versions, and the update's pause is exactly the time it holds the lock.
        self._lock = threading.Lock()
        self._cache_kwarg = _cache_kwarg_name(model)
        self._continuations: ContinuationCache[_Suspended] = ContinuationCache(
            CONTINUATION_CACHE_TOKENS
        )
        self._records_routing = record_routing and moe_shape(model) is not None
        # Set for the length of a generate call on an MoE model: every router's choices.
        self._recorder: RoutingRecorder | None = None

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context_tokens(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        """Device the model runs on."""
        return self.model.device

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[Completion]:
        check_request(
            prompts,
            params,
            num_samples,
            self.model.config.vocab_size,
            self.model.config.max_position_embeddings,
            "the model's positions",
        )
        row_prompts = [prompt for prompt in prompts for _ in range(num_samples)]
        rows: list[_Row] = []
        with self._lock, torch.inference_mode(), sdpa_kernel(DECODE_SDPA_BACKENDS):
            version = self._version
            with self._recording():
                generator = make_generator(params.seed, self.device)
                for start in range(0, len(row_prompts), self.max_batch_rows):
                    chunk = row_prompts[start : start + self.max_batch_rows]
                    rows.extend(self._generate_batch(chunk, params, generator))
        return [_to_completion(row, index, num_samples, version) for index, row in enumerate(rows)]

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """Record MoE routing during the forwards inside (nothing for a dense model)."""
        if not self._records_routing:
            yield
            return
        with record_routing(self.model) as recorder:
            self._recorder = recorder
            try:
                yield
            finally:
                self._recorder = None

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        return self._copy_in(state, version, older=False)

    def restore_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        return self._copy_in(state, version, older=True)

    def _copy_in(self, state: Mapping[str, torch.Tensor], version: int, *, older: bool) -> float:
        staged = stage_update(self._tensors, state)  # moved and cast before the pause
        with self._lock:
            if not older:
                check_version(version, self._version)
            start_s = time.perf_counter()
            with torch.no_grad():
                for name, tensor in staged.items():
                    self._tensors[name].copy_(tensor)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._version = version
            return time.perf_counter() - start_s

    def score(self, prompts: list[list[int]], continuations: list[list[int]]) -> ContinuationScores:
        self._check_scoring(prompts, continuations)
        pairs = list(zip(prompts, continuations, strict=True))
        scored: list[list[float]] = []
        with self._lock, torch.inference_mode():
            version = self._version
            for start in range(0, len(pairs), self.max_batch_rows):
                scored.extend(self._score_batch(pairs[start : start + self.max_batch_rows]))
        return ContinuationScores(logprobs=scored, policy_version=version)

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return {name: tensor.detach() for name, tensor in self._tensors.items()}

    def write_in_place(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        with self._lock:
            check_version(version, self._version)
            start_s = time.perf_counter()
            result = write()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._version = version
            return result, time.perf_counter() - start_s

    def _check_scoring(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        """Raise ValueError naming the problem if these continuations cannot be scored."""
        if len(prompts) != len(continuations):
            raise ValueError(
                f"{len(prompts)} prompts but {len(continuations)} continuations: pass one each"
            )
        if any(not continuation for continuation in continuations):
            raise ValueError("continuations must be non-empty token-id lists")
        max_positions = self.model.config.max_position_embeddings
        vocab_size = self.model.config.vocab_size
        limit = "the model's positions"
        check_request(prompts, SamplingParams(max_tokens=1), 1, vocab_size, max_positions, limit)
        if any(not 0 <= token < vocab_size for c in continuations for token in c):
            raise ValueError(f"continuation token ids must lie in [0, {vocab_size})")
        lengths = [len(p) + len(c) for p, c in zip(prompts, continuations, strict=True)]
        if max(lengths) > max_positions:
            raise ValueError(
                f"a prompt + continuation of {max(lengths)} tokens exceeds the model's "
                f"{max_positions} positions; shorten the prompt or the choices"
            )

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per pair, the continuation's token logprobs; one right-padded forward pass."""
        width = max(len(prompt) + len(continuation) for prompt, continuation in pairs)
        input_ids = torch.full((len(pairs), width), self.tokenizer.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for row, (prompt, continuation) in enumerate(pairs):
            sequence = torch.tensor([*prompt, *continuation], dtype=torch.long)
            input_ids[row, : len(sequence)] = sequence
            attention_mask[row, : len(sequence)] = 1
        logprobs = sequence_logprobs(
            self.model, input_ids.to(self.device), attention_mask.to(self.device)
        )  # [B, width - 1], entry t scores token t + 1
        return [
            logprobs[row, len(prompt) - 1 : len(prompt) + len(continuation) - 1].tolist()
            for row, (prompt, continuation) in enumerate(pairs)
        ]

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[_Row]:
        """Completions of `prompts` (one row each), decoded together."""
        rows = [_Row() for _ in prompts]
        resumed = self._resume(prompts, rows)
        if resumed is not None:
            batch, logits, generator = resumed
        else:
            batch, logits = self._prefill(prompts, rows)
        for step in range(params.max_tokens):
            sampled = sample_next_tokens(logits, params, generator)
            running = self._record(rows, batch.live, sampled, params)
            if not running:
                break
            if step == params.max_tokens - 1:
                suspended = _Suspended(batch, sampled.token_ids, generator)
                self._suspend(prompts, rows, running, suspended)
                break
            next_ids = _advance(batch, running, sampled.token_ids)
            logits = self._forward(next_ids, batch, _next_positions(batch), rows)
        for row in rows:
            row.finish_reason = row.finish_reason or "length"
        return rows

    def _prefill(self, prompts: list[list[int]], rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        """A new batch of `prompts` and the logits of each one's next token."""
        input_ids, attention_mask = left_pad(prompts, self.tokenizer.pad_id, self.device)
        batch = _Batch(
            list(range(len(prompts))), attention_mask, DynamicCache(config=self.model.config)
        )
        positions = position_ids_from_mask(attention_mask)
        return batch, self._forward(input_ids, batch, positions, rows)

    def _resume(
        self, prompts: list[list[int]], rows: list[_Row]
    ) -> tuple[_Batch, torch.Tensor, torch.Generator] | None:
        """The batch a call that cut exactly these rows left, fed its last tokens, and its
        RNG; or None. `rows` start with the routing recorded when their cache was computed."""
        suspended = self._continuations.take(prompts)
        if suspended is None:
            return None
        for row, routing in zip(rows, suspended.routing, strict=True):
            row.routing = list(routing)
        batch = suspended.batch
        next_ids = _advance(batch, list(range(len(batch.live))), suspended.last_ids)
        logits = self._forward(next_ids, batch, _next_positions(batch), rows)
        return batch, logits, suspended.generator

    def _suspend(
        self, prompts: list[list[int]], rows: list[_Row], running: list[int], state: _Suspended
    ) -> None:
        """Keep the rows cut by max_tokens (slots `running`) for a call that continues them."""
        batch = state.batch
        if len(running) < len(batch.live):
            keep = torch.tensor(running, device=state.last_ids.device)
            batch.cache.batch_select_indices(keep)
            batch.attention_mask = batch.attention_mask[keep]
            state.last_ids = state.last_ids[keep]
        indices = [batch.live[slot] for slot in running]
        sequences = [[*prompts[i], *rows[i].token_ids] for i in indices]
        state.routing = [rows[i].routing for i in indices]
        batch.live = list(range(len(indices)))  # row i of the continuing call
        self._continuations.put(sequences, state)

    def _forward(
        self, input_ids: torch.Tensor, batch: _Batch, position_ids: torch.Tensor, rows: list[_Row]
    ) -> torch.Tensor:
        """Logits [B, V] of the next token after `input_ids`, extending the batch's cache
        (and the live `rows`' routing, on an MoE model)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,  # prefill: skip the [B, T, V] logits of the prompt
            **{self._cache_kwarg: batch.cache},
        )
        # A model that ignored the cache would decode without context: fail loudly instead.
        assert batch.cache.get_seq_length() == batch.attention_mask.shape[1], "KV cache unused"
        if self._recorder is not None:
            _keep_routing(self._recorder, batch, input_ids.shape[1], rows)
        return outputs.logits[:, -1]

    def _record(
        self, rows: list[_Row], live: list[int], sampled: SampledTokens, params: SamplingParams
    ) -> list[int]:
        """Append this step's tokens to the live rows; return the slots still running."""
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        raw_logprobs = sampled.raw_logprobs.tolist()
        running: list[int] = []
        for slot, row_index in enumerate(live):
            row = rows[row_index]
            row.token_ids.append(token_ids[slot])
            row.logprobs.append(logprobs[slot])
            row.raw_logprobs.append(raw_logprobs[slot])
            if hits_stop(row.token_ids, params, self.tokenizer):
                row.finish_reason = "stop"
            else:
                running.append(slot)
        return running


def _cache_kwarg_name(model: PreTrainedModel) -> str:
    """Name of the KV-cache argument of `model.forward`: `cache` from transformers ~5.2x on,
    `past_key_values` before (still accepted, with a FutureWarning, until 5.40)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _keep_routing(recorder: RoutingRecorder, batch: _Batch, num_fed: int, rows: list[_Row]) -> None:
    """Append the newest forward's routing of each live row's real (unpadded) positions."""
    routing = recorder.take(len(batch.live))  # [B, num_fed, L, k]
    if num_fed == 1:  # a decode step: every row fed one real token (no mask, no device sync)
        for slot, row_index in enumerate(batch.live):
            rows[row_index].routing.append(routing[slot])
        return
    real = batch.attention_mask[:, -num_fed:].bool()
    for slot, row_index in enumerate(batch.live):
        rows[row_index].routing.append(routing[slot][real[slot]])


def _next_positions(batch: _Batch) -> torch.Tensor:
    """Position ids [B, 1] of the token fed next: real tokens so far, minus one."""
    return batch.attention_mask.sum(dim=-1, keepdim=True) - 1


def _advance(batch: _Batch, running: list[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Drop finished rows from `batch`, extend its mask by one step; return next input [B, 1]."""
    if len(running) < len(batch.live):
        keep = torch.tensor(running, device=token_ids.device)
        batch.cache.batch_select_indices(keep)
        batch.attention_mask = batch.attention_mask[keep]
        batch.live = [batch.live[slot] for slot in running]
        token_ids = token_ids[keep]
    ones = batch.attention_mask.new_ones((len(batch.live), 1))
    batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
    return token_ids.unsqueeze(-1)


def _to_completion(row: _Row, index: int, num_samples: int, version: int) -> Completion:
    """The public record of row `index` of a request with `num_samples` rows per prompt."""
    assert row.finish_reason is not None, "every row is finished after decoding"
    return Completion(
        prompt_index=index // num_samples,
        sample_index=index % num_samples,
        token_ids=row.token_ids,
        logprobs=row.logprobs,
        raw_logprobs=row.raw_logprobs,
        finish_reason=row.finish_reason,
        policy_version=version,
        routed_experts=torch.cat(row.routing).cpu() if row.routing else None,
    )
