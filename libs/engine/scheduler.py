"""The `paged` engine's scheduler: which sequences prefill, which decode, at every step.

A sequence moves waiting -> prefilling -> decoding -> finished. At each step:

1. admit: waiting sequences (oldest first) take KV blocks, as long as the running rows stay
   within `max_rows` and the blocks for prompt + max_tokens are lendable. The longest
   registered prefix of the prompt is shared (see `libs.engine.kv_cache`), leaving at least
   its last token to compute (its logits give the first sampled token); the prompt's own
   full blocks are registered at once, so the rest of a GRPO group admitted in the same step
   shares them, computed in the same forward pass (or, past the chunk budget, a later one).
2. prefill: short prompts (every remaining prompt under the engine's eager threshold) go
   into the decode step itself, as extra rows of its graph, up to the staged-row budget, at
   once: a prompt waits for no other. A long prompt is prefilled eagerly, up to
   `prefill_tokens` prompt tokens a step, in chunks, so it never stalls the decoding rows
   for long (while rows decode, such prefills are gathered for up to
   PREFILL_INTERVAL_STEPS steps: see `prefill_due`);
3. decode: every decoding row one token.

Blocks for the whole of `max_tokens` are taken at admission, so a running sequence never
waits for memory and nothing is ever preempted.

Sequences hold their own results; a `Request` (one `generate` call) ends when all of its
sequences are done, and goes to `ended` for the engine to resolve its future.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from libs.engine.base import Completion, FinishReason, SamplingParams
from libs.engine.kv_cache import NO_PARENT, BlockPool
from libs.engine.model_runner import PrefillChunk
from libs.engine.routing_table import RoutingCopy


def _running_future() -> Future[list[Completion]]:
    """A future already running: a caller's cancel cannot take it from the engine, which
    resolves it when the request ends whatever the caller did meanwhile."""
    future: Future[list[Completion]] = Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass(eq=False)
class Request:
    """One `generate` call: its sequences, in (prompt, sample) order, and its outcome."""

    params: SamplingParams
    num_samples: int
    version: int = -1
    """The weights' version the request runs on (set when it joins the queue); a swap
    between steps moves its running sequences on (`Sequence.version_switches`)."""
    sequences: list[Sequence] = field(default_factory=list)
    num_unfinished: int = 0
    error: BaseException | None = None
    future: Future[list[Completion]] = field(default_factory=_running_future)

    def resolve(self) -> None:
        """Hand the outcome to the future (the request has ended)."""
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.completions())

    def routing_ready(self) -> bool:
        """True once every sequence's routing (MoE) has reached the host, or none is coming."""
        return self.error is not None or all(
            seq.routing is None or seq.routing.ready() for seq in self.sequences
        )

    def completions(self) -> list[Completion]:
        """The finished sequences as completions, in (prompt, sample) order."""
        return [
            Completion(
                prompt_index=index // self.num_samples,
                sample_index=index % self.num_samples,
                token_ids=seq.generated,
                logprobs=seq.logprobs,
                raw_logprobs=seq.raw_logprobs,
                finish_reason=seq.finish_reason or "length",
                policy_version=self.version,
                policy_version_end=seq.version_switches[-1][1] if seq.version_switches else None,
                version_switches=tuple(seq.version_switches),
                routed_experts=None if seq.routing is None else seq.routing.result(),
            )
            for index, seq in enumerate(self.sequences)
        ]


@dataclass(eq=False)
class Sequence:
    """One completion being generated: its tokens, its blocks, how much KV it has."""

    request: Request
    token_ids: list[int]
    """Prompt, then the generated tokens."""
    prompt_len: int
    seed: int
    blocks: list[int] = field(default_factory=list)
    content_ids: list[int] = field(default_factory=list)
    """Content id of each leading full block registered so far (the prefix-cache chain)."""
    num_shared: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    num_computed: int = 0
    """Tokens whose K and V are in the cache (a prefix of token_ids)."""
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    version_switches: list[tuple[int, int]] = field(default_factory=list)
    """(index of the first generated token sampled with a version, that version) for every
    version after the request's (see `Completion.version_switches`)."""
    routing: RoutingCopy | None = None
    """The experts each MoE layer chose at each fed position, on its way to the host (set
    when the sequence finishes, by a model that records routing)."""

    @property
    def params(self) -> SamplingParams:
        """The request's sampling rule."""
        return self.request.params


PREFILL_INTERVAL_STEPS = 8
"""Decode steps a small prefill may wait for others to join it (see `prefill_due`)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class Scheduler:
    """Queues of sequences and the block bookkeeping between steps (no tensors)."""

    def __init__(self, pool: BlockPool, max_rows: int, prefill_tokens: int, version: int) -> None:
        self.pool = pool
        self.version = version
        """The version of the weights the steps run on now (the engine moves it when it
        writes weights, between steps): the version of every token sampled."""
        self.block_size = pool.block_size
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        """Running rows, in the order of the runner's `DecodeRows`."""
        self._steps_since_prefill = 0
        self.ended: list[Request] = []
        """Requests that ended (done or failed) and are not yet resolved."""

    def has_work(self) -> bool:
        """True while any sequence is not finished."""
        return bool(self.waiting or self.prefilling or self.decoding)

    def admit(self) -> None:
        """Move waiting sequences to prefilling while rows and blocks allow, oldest first."""
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_rows:
            if not self._take_blocks(self.waiting[0]):
                return
            self.prefilling.append(self.waiting.popleft())

    def prefill_due(self) -> bool:
        """Whether this step prefills: always when no row decodes or a chunk's worth of
        prompt tokens waits; otherwise once every `PREFILL_INTERVAL_STEPS` decode steps, so
        the small prefills of requests arriving one by one (agent turns) share a step's fixed
        cost instead of each adding it to a decode step."""
        if not self.prefilling:
            return False
        self._steps_since_prefill += 1
        waiting = sum(seq.prompt_len - seq.num_computed for seq in self.prefilling)
        due = (
            not self.decoding
            or waiting >= self.prefill_tokens
            or self._steps_since_prefill >= PREFILL_INTERVAL_STEPS
        )
        if due:
            self._steps_since_prefill = 0
        return due

    def plan_prefill(self, budget: int | None = None) -> list[tuple[Sequence, PrefillChunk]]:
        """This step's prompt chunks, within `budget` tokens (default `prefill_tokens`). A
        sequence that shares blocks another sequence has not computed yet joins the step
        that computes them (each layer writes every chunk's K and V before any chunk
        attends), or waits."""
        budget = self.prefill_tokens if budget is None else budget
        size = self.block_size
        chunks: list[tuple[Sequence, PrefillChunk]] = []
        filled_now: set[int] = set()  # blocks this step's earlier chunks complete
        for seq in self.prefilling:
            if budget <= 0:
                break
            shared = seq.blocks[: seq.num_shared // size]
            if not all(self.pool.is_computed(b) or b in filled_now for b in shared):
                continue
            start = seq.num_computed
            length = min(seq.prompt_len - start, budget)
            chunks.append(
                (seq, PrefillChunk(seq.token_ids[start : start + length], start, seq.blocks))
            )
            filled_now.update(seq.blocks[start // size : (start + length) // size])
            budget -= length
        return chunks

    def on_computed(self, seq: Sequence, num_computed: int) -> None:
        """`seq` now has K and V for its first `num_computed` tokens: mark and register the
        blocks that became full."""
        first_new = seq.num_computed // self.block_size
        seq.num_computed = num_computed
        for index in range(first_new, num_computed // self.block_size):
            self.pool.mark_computed(seq.blocks[index])
        self._register_full_blocks(seq, num_computed)

    def record(self, seq: Sequence, token: int, logprob: float, raw_logprob: float) -> None:
        """Append one sampled token to `seq` (a switch first when a newer version sampled
        it than its previous token, or than its request's version for the first token)."""
        switches = seq.version_switches
        if self.version != (switches[-1][1] if switches else seq.request.version):
            switches.append((len(seq.generated), self.version))
        seq.token_ids.append(token)
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        seq.raw_logprobs.append(raw_logprob)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` is done: give its blocks back and tell its request."""
        seq.finish_reason = reason
        self.pool.release(seq.blocks)
        seq.blocks = []
        request = seq.request
        request.num_unfinished -= 1
        if request.num_unfinished == 0:
            self.ended.append(request)

    def fail_all(self, error: BaseException) -> None:
        """Fail every unfinished request with `error` and free everything they held."""
        for seq in [*self.waiting, *self.prefilling, *self.decoding]:
            if seq.blocks:
                self.pool.release(seq.blocks)
                seq.blocks = []
            if seq.request.error is None:
                seq.request.error = error
                self.ended.append(seq.request)
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()

    def _take_blocks(self, seq: Sequence) -> bool:
        """Give `seq` its blocks (shared prefix + fresh ones); False if they do not fit now."""
        shared = self.pool.match(seq.token_ids, limit_tokens=seq.prompt_len - 1)
        total = blocks_needed(seq.prompt_len + seq.params.max_tokens, self.block_size)
        if total - len(shared) > self.pool.num_lendable:
            self.pool.release([block for block, _ in shared])
            return False
        seq.blocks = [block for block, _ in shared]
        seq.blocks += [self.pool.allocate() for _ in range(total - len(shared))]
        seq.content_ids = [content_id for _, content_id in shared]
        seq.num_shared = seq.num_computed = len(shared) * self.block_size
        self._register_full_blocks(seq, seq.prompt_len)
        return True

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among `seq`'s first `num_tokens` tokens not yet registered."""
        size = self.block_size
        for index in range(len(seq.content_ids), num_tokens // size):
            parent = seq.content_ids[-1] if seq.content_ids else NO_PARENT
            tokens = seq.token_ids[index * size : (index + 1) * size]
            seq.content_ids.append(self.pool.register(seq.blocks[index], parent, tokens))
