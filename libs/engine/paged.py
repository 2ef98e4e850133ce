"""The `paged` engine: continuous batching over a paged KV cache, decode steps as CUDA graphs.

For GPUs (it also runs, eagerly, on CPU). Every `generate` call, from any thread, adds its
sequences to one running batch: they join at the next step and leave when they finish, so
one agent's next turn starts at once instead of waiting for another call's slowest row.
`submit` does the same without waiting: it returns the call's future, which the driver
thread resolves when the call's last sequence finishes (the rollout batcher awaits it, so no
thread waits per request; a call submitted during a weight write joins after it).
One driver thread runs the steps while there is work (see `libs.engine.scheduler`): admit,
then one forward that decodes a token for every running row and computes the waiting
prompts beside them as extra rows of the same graph (`libs.engine.model_runner`; a prompt
of 2,048 tokens or more is prefilled eagerly, in chunks, instead), then sample with
per-row parameters and seeds (`libs.engine.row_sampling`). The KV cache is allocated
once, sized from free GPU memory, and shares prefixes (a GRPO group's prompt, an episode's
earlier turns) between sequences (`libs.engine.kv_cache`).

    engine = PagedEngine(build_policy(PolicyConfig(preset="qwen2-0.5b")), tokenizer, 256)
    completions = engine.generate([prompt_ids], SamplingParams(max_tokens=256), 16)

Or through the factory: `EngineConfig(type="paged")`; the rollout-worker takes it from
RLPIPE_ROLLOUT_WORKER_ENGINE_TYPE=paged. Models: Llama and Qwen2 (others are refused).

Its throughput against `hf` (bench/engine_bench.py, bench/harness_bench.py): docs/benchmarks.md.

Weights: `write_in_place` and `update_weights` wait until no call is running
(so every completion still comes from exactly one version), write into the model's own
parameter storage (the captured graphs read it), refresh the runner's fused copies, and
drop the prefix cache (its KV came from the old weights). The pause reported is that write
(7 to 12 ms for the 0.5B model on an H200).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

import torch
from transformers import PreTrainedModel

from libs.engine.base import (
    Completion,
    ContinuationScores,
    InferenceEngine,
    SamplingParams,
    T,
)
from libs.engine.hf import HFEngine
from libs.engine.kv_cache import BlockPool, CacheLayout, PagedKVCache, blocks_for_memory
from libs.engine.model_runner import PagedModelRunner, PrefillChunk, check_architecture
from libs.engine.requests import check_request, check_version, hits_stop, stage_update
from libs.engine.row_sampling import row_seed, sample_rows, step_seeds
from libs.engine.sampling import SampledTokens
from libs.engine.scheduler import Request, Scheduler, Sequence, blocks_needed
from libs.tokenizer import Tokenizer

CPU_KV_CACHE_TOKENS = 65_536
"""KV cache tokens on CPU when not given (allocated lazily: untouched pages cost nothing)."""
GPU_TOKENS_PER_ROW = 4096
"""On a GPU the cache holds at most this many tokens per decode row when not given."""
EAGER_PREFILL_ABOVE_GPU = 2048
EAGER_PREFILL_ABOVE_CPU = 128
"""Prompt tokens left from which a prompt is prefilled eagerly rather than staged in the
decode step (see `PagedEngine.__init__`), with CUDA graphs and without."""


class PagedEngine(InferenceEngine):
    """`InferenceEngine` with continuous batching, a paged KV cache and CUDA-graph decoding."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        max_batch_rows: int = 64,
        policy_version: int = 0,
        *,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        kv_cache_memory_fraction: float = 0.3,
        prefill_chunk_tokens: int = 2048,
        staged_prefill_tokens: int = 512,
        eager_prefill_above: int | None = None,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if staged_prefill_tokens < 1:
            raise ValueError(f"staged_prefill_tokens must be >= 1, got {staged_prefill_tokens}")
        check_architecture(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._version = policy_version
        self._tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        layout = self._layout(block_size, kv_cache_tokens, kv_cache_memory_fraction)
        self.cache = PagedKVCache(layout, model.device)
        self.pool = BlockPool(layout.num_blocks, block_size)
        positions = int(model.config.max_position_embeddings)
        self._max_context = min(positions, self.pool.capacity * block_size)
        graphs = model.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        table_width = blocks_needed(self._max_context, block_size)
        # Prompts with fewer than `eager_prefill_above` tokens left are prefilled inside the
        # decode step, `staged_prefill_tokens` at most a step; longer ones eagerly. Staged
        # tokens attend through the decode kernel, one query row each: on a GPU that beats a
        # separate eager forward up to a few thousand tokens (16 samples of a 1,024-token
        # prompt on an NVIDIA H200, 3 runs each in one process: 10.0-10.7K tokens/s eager,
        # 10.7-11.7K staged); on CPU, where each row gathers its whole context, only short
        # prompts (agent turns, arith) gain.
        if eager_prefill_above is None:
            eager_prefill_above = EAGER_PREFILL_ABOVE_GPU if graphs else EAGER_PREFILL_ABOVE_CPU
        self.eager_prefill_above = eager_prefill_above
        with torch.no_grad():
            self.runner = PagedModelRunner(
                model, self.cache, max_batch_rows, table_width, graphs, staged_prefill_tokens
            )
        self.scheduler = Scheduler(self.pool, max_batch_rows, prefill_chunk_tokens)
        self._stamp = self._weights_stamp()  # parameters as the fused copies last saw them
        self._scorer = HFEngine(model, tokenizer, max_batch_rows, policy_version)
        self._lock = threading.Lock()  # the scheduler's queues, the driver, request counts
        self._changed = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step, or one weight write, at a time
        self._write_lock = threading.Lock()  # one weight write at a time
        self._num_running_calls = 0  # requests queued or running, not yet ended
        self._writing = False
        self._deferred: list[Request] = []  # submitted during a weight write
        self._driver: threading.Thread | None = None
        # The driver's own CUDA stream, so the engine's back-to-back steps do not hold up
        # another thread's work on the default stream: the rollout-worker decodes the next
        # weight version with synchronous copies on it while generation goes on, and behind
        # a busy default stream each copy waited for the engine's queued steps.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._stream is not None:
            torch.cuda.synchronize(self.device)  # cache, rows and fused weights set up
        self._entropy = random.SystemRandom()
        self.num_steps = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (not shared from the prefix cache)
        # Seconds per phase, summed over steps: the device work of a decode step and the wait
        # for its tokens, then the Python bookkeeping after it (GPU idle meanwhile), prefill.
        self.timings_s = {"decode_device": 0.0, "decode_host": 0.0, "prefill": 0.0}

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def continuous_batching(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        """Device the model runs on."""
        return self.model.device

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[Completion]:
        return self.submit(prompts, params, num_samples).result()

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> Future[list[Completion]]:
        check_request(
            prompts,
            params,
            num_samples,
            self.model.config.vocab_size,
            self._max_context,
            "model positions and KV cache size",
        )
        request = self._request(prompts, params, num_samples)
        with self._lock:
            if self._writing:  # joins once the write is done, on the new weights
                self._deferred.append(request)
            else:
                self._enqueue(request)
        return request.future

    def _enqueue(self, request: Request) -> None:
        """Queue a request on the weights held now (called with `_lock` held)."""
        request.version = self._version
        self._num_running_calls += 1
        self.scheduler.waiting.extend(request.sequences)
        self._start_driver()

    def _resolve_ended(self) -> None:
        """Resolve the futures of the requests that ended, then count them out (so a weight
        write that waits for running calls starts after their futures are resolved). Called
        by the driver with no lock held: a future's callbacks run here. `scheduler.ended`
        is the driver's alone (its steps and fail_all fill it), so no lock guards it."""
        ended, self.scheduler.ended = self.scheduler.ended, []
        if not ended:
            return
        for request in ended:
            request.resolve()
        with self._lock:
            self._num_running_calls -= len(ended)
            self._changed.notify_all()

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        staged = stage_update(self._tensors, state)  # moved and cast before the pause

        def copy() -> None:
            for name, tensor in staged.items():
                self._tensors[name].copy_(tensor)

        return self.write_in_place(copy, version)[1]

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return {name: tensor.detach() for name, tensor in self._tensors.items()}

    def write_in_place(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        with self._write_lock:
            with self._lock:
                check_version(version, self._version)
                self._writing = True  # new calls wait; running ones finish on the old weights
                while self._num_running_calls:
                    self._changed.wait()
            try:
                with self._step_lock, torch.no_grad():
                    if self._stream is not None:  # the last step's trailing bookkeeping
                        self._stream.synchronize()
                    start_s = time.perf_counter()
                    result = write()
                    self.runner.refresh_weights()  # fused copies of the new parameters
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self.pool.forget_all()  # cached prefixes hold the old weights' KV
                    self._stamp = self._weights_stamp()
                    self._version = version
                    return result, time.perf_counter() - start_s
            finally:
                with self._lock:
                    self._writing = False
                    deferred, self._deferred = self._deferred, []
                    for request in deferred:
                        self._enqueue(request)
                    self._changed.notify_all()

    def score(self, prompts: list[list[int]], continuations: list[list[int]]) -> ContinuationScores:
        with self._step_lock:
            scores = self._scorer.score(prompts, continuations)
            return ContinuationScores(scores.logprobs, self._version)

    def _layout(
        self, block_size: int, kv_cache_tokens: int | None, memory_fraction: float
    ) -> CacheLayout:
        """The cache's shape: `kv_cache_tokens` if given, else sized from free memory."""
        config = self.model.config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        layout = CacheLayout(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=int(head_dim),
            block_size=block_size,
            num_blocks=0,
            dtype=next(self.model.parameters()).dtype,
        )
        if kv_cache_tokens is not None:
            num_blocks = blocks_needed(kv_cache_tokens, block_size) + 1
        elif self.model.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.model.device)
            budget = int(free_bytes * memory_fraction)
            num_blocks = blocks_for_memory(budget, layout.bytes_per_token, block_size)
            cap = blocks_needed(self.max_batch_rows * GPU_TOKENS_PER_ROW, block_size) + 1
            num_blocks = min(num_blocks, cap)
        else:
            num_blocks = blocks_needed(CPU_KV_CACHE_TOKENS, block_size) + 1
        return CacheLayout(**{**layout.__dict__, "num_blocks": num_blocks})

    def _request(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int
    ) -> Request:
        """A request of `num_samples` sequences per prompt, each with its own seed."""
        request = Request(params, num_samples)
        for index in range(len(prompts) * num_samples):
            prompt = prompts[index // num_samples]
            seed = row_seed(params.seed, index, self._entropy.getrandbits(62))
            request.sequences.append(Sequence(request, list(prompt), len(prompt), seed))
        request.num_unfinished = len(request.sequences)
        return request

    def _start_driver(self) -> None:
        """Start the step loop unless it runs (called with `_lock` held). Not a daemon: it
        exits by itself once no sequence is left, and interpreter exit waits for that."""
        if self._driver is None:
            self._driver = threading.Thread(target=self._drive, name="paged-engine")
            self._driver.start()

    def _drive(self) -> None:
        """Run steps while any sequence is unfinished; a failed step fails every request."""
        with self._on_engine_stream():
            with self._step_lock, torch.no_grad():
                self._catch_up_with_outside_writes()
            while True:
                with self._lock:
                    if not self.scheduler.has_work():
                        self._driver = None
                        return
                try:
                    with self._step_lock, torch.no_grad():
                        self._step()
                except Exception as exc:  # the callers waiting on their requests re-raise it
                    with self._lock:
                        self.scheduler.fail_all(exc)
                        self.runner.rows.clear()
                self._resolve_ended()

    @contextlib.contextmanager
    def _on_engine_stream(self) -> Iterator[None]:
        """Run the driver's GPU work on the engine's own stream, after whatever other threads
        queued on the default stream before it started (a trainer's optimizer writing a model
        this engine shares). CPU: nothing to do."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def _catch_up_with_outside_writes(self) -> None:
        """If the parameters changed without `write_in_place` (a trainer's optimizer stepping
        a model it shares with this engine, as the eval gate does), refresh the fused copies
        and drop the cached prefixes before the next step. Runs while nothing decodes."""
        stamp = self._weights_stamp()
        if stamp != self._stamp:
            self.runner.refresh_weights()
            self.pool.forget_all()
            self._stamp = stamp

    def _weights_stamp(self) -> int:
        """Sum of the parameters' version counters (torch bumps one at every in-place write)."""
        return sum(tensor._version for tensor in self._tensors.values())

    def _step(self) -> None:
        """Admit, then one forward: short prompts staged beside the decoding rows (one graph
        replay), or a long prompt's chunk eagerly and then the decode step."""
        with self._lock:
            self.scheduler.admit()
        scheduler = self.scheduler
        left = [seq.prompt_len - seq.num_computed for seq in scheduler.prefilling]
        if left and max(left) >= self.eager_prefill_above:
            chunks = scheduler.plan_prefill() if scheduler.prefill_due() else []
            if chunks:
                start_s = time.perf_counter()
                self._prefill(chunks)
                self.timings_s["prefill"] += time.perf_counter() - start_s
            if scheduler.decoding:
                self._decode([])
        else:
            budget = self.runner.prefill_rows
            staged = scheduler.plan_prefill(budget) if scheduler.prefilling else []
            if staged or scheduler.decoding:
                self._decode(staged)
        self.num_steps += 1

    def _prefill(self, chunks: list[tuple[Sequence, PrefillChunk]]) -> None:
        """Run the chunks; sequences whose prompt is now computed sample their first token."""
        logits = self.runner.prefill([chunk for _, chunk in chunks])
        self.num_prefill_tokens += sum(len(chunk.token_ids) for _, chunk in chunks)
        finishing = []
        for row, (seq, chunk) in enumerate(chunks):
            self.scheduler.on_computed(seq, chunk.start + len(chunk.token_ids))
            if seq.num_computed == seq.prompt_len:
                finishing.append(row)
        if not finishing:
            return
        seqs = [chunks[row][0] for row in finishing]
        sampled = self._sample(logits[finishing], seqs, [0] * len(seqs))
        self._first_tokens(seqs, _host_rows(sampled))

    def _join_decoding(self, seqs: list[Sequence]) -> None:
        """Add sequences that sampled their first token to the running decode rows."""
        self.runner.rows.append(
            input_ids=[seq.token_ids[-1] for seq in seqs],
            positions=[len(seq.token_ids) - 1 for seq in seqs],
            tables=[seq.blocks for seq in seqs],
            temperatures=[seq.params.temperature for seq in seqs],
            top_ps=[seq.params.top_p for seq in seqs],
            seeds=[seq.seed for seq in seqs],
        )
        self.scheduler.decoding.extend(seqs)

    def _decode(self, staged: list[tuple[Sequence, PrefillChunk]]) -> None:
        """One token for every running row, and the `staged` prompt chunks computed in the
        same forward (their rows after the running ones); finished rows leave the batch and
        prompts that are now computed join it with their first token."""
        rows, decoding = self.runner.rows, self.scheduler.decoding
        n = rows.num_rows
        start_s = time.perf_counter()
        end, picked = self._stage(staged) if staged else (n, [])
        logits = self.runner.decode(end)
        if picked:  # the decoding rows, then the last row of each prompt that completes
            chosen = torch.tensor(list(range(n)) + [row for row, _ in picked])
            chosen = chosen.to(logits.device, non_blocking=True)
            logits = logits[chosen]
            temperatures, top_ps = rows.temperatures[chosen], rows.top_ps[chosen]
            seeds = step_seeds(rows.seeds[chosen], rows.num_generated[chosen])
        else:
            logits = logits[:n]
            temperatures, top_ps = rows.temperatures[:n], rows.top_ps[:n]
            seeds = step_seeds(rows.seeds[:n], rows.num_generated[:n])
        joining = [seq for _, seq in picked]
        all_top_p_one = all(seq.params.top_p >= 1.0 for seq in [*decoding, *joining])
        sampled = sample_rows(logits, temperatures, top_ps, seeds, all_top_p_one=all_top_p_one)
        if end > n:
            rows.unstage(end)
        if n:
            rows.advance(sampled.token_ids[:n])
        results = _host_rows(sampled)
        host_s = time.perf_counter()
        keep: list[int] = []
        running = zip(decoding, results[:n], strict=True)
        for index, (seq, (token, logprob, raw)) in enumerate(running):
            self.scheduler.on_computed(seq, seq.num_computed + 1)  # the input token's KV
            self.scheduler.record(seq, token, logprob, raw)
            if not self._stop_if_done(seq):
                keep.append(index)
        if len(keep) < n:
            rows.keep(keep)
            self.scheduler.decoding = [decoding[index] for index in keep]
        if staged:
            self.num_prefill_tokens += sum(len(chunk.token_ids) for _, chunk in staged)
            for seq, chunk in staged:
                self.scheduler.on_computed(seq, chunk.start + len(chunk.token_ids))
            self._first_tokens(joining, results[n:])
        self.timings_s["decode_device"] += host_s - start_s
        self.timings_s["decode_host"] += time.perf_counter() - host_s

    def _stage(
        self, staged: list[tuple[Sequence, PrefillChunk]]
    ) -> tuple[int, list[tuple[int, Sequence]]]:
        """Stage the chunks' tokens as rows after the running ones; the rows in use, and
        (row, sequence) of each chunk that completes its prompt (its last token's row)."""
        rows = self.runner.rows
        ids: list[int] = []
        positions: list[int] = []
        table_of_row: list[int] = []
        picked: list[tuple[int, Sequence]] = []
        for index, (seq, chunk) in enumerate(staged):
            length = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + length))
            table_of_row.extend([index] * length)
            if chunk.start + length == seq.prompt_len:
                picked.append((rows.num_rows + len(ids) - 1, seq))
        seqs = [seq for seq, _ in staged]
        sampling = (
            [seqs[i].params.temperature for i in table_of_row],
            [seqs[i].params.top_p for i in table_of_row],
            [seqs[i].seed for i in table_of_row],
        )
        tables = [seq.blocks for seq in seqs]
        return rows.stage(ids, positions, tables, table_of_row, sampling), picked

    def _first_tokens(self, seqs: list[Sequence], results: list[tuple[int, float, float]]) -> None:
        """Sequences whose prompt is computed take their first sampled token; those it does
        not finish join the decoding rows."""
        joined: list[Sequence] = []
        for seq, (token, logprob, raw) in zip(seqs, results, strict=True):
            self.scheduler.prefilling.remove(seq)
            self.scheduler.record(seq, token, logprob, raw)
            if not self._stop_if_done(seq):
                joined.append(seq)
        if joined:
            self._join_decoding(joined)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], counts: list[int]
    ) -> SampledTokens:
        """One token for each of `seqs` from `logits` [len(seqs), V] (prefill's first token)."""
        device = logits.device
        temperatures = torch.tensor([seq.params.temperature for seq in seqs], device=device)
        top_ps = torch.tensor([seq.params.top_p for seq in seqs], device=device)
        row_seeds = torch.tensor([seq.seed for seq in seqs], device=device)
        seeds = step_seeds(row_seeds, torch.tensor(counts, device=device))
        all_top_p_one = all(seq.params.top_p >= 1.0 for seq in seqs)
        return sample_rows(logits, temperatures, top_ps, seeds, all_top_p_one=all_top_p_one)

    def _stop_if_done(self, seq: Sequence) -> bool:
        """Finish `seq` if its newest token ends it; True if it did."""
        if hits_stop(seq.generated, seq.params, self.tokenizer):
            self.scheduler.finish(seq, "stop")
        elif len(seq.generated) >= seq.params.max_tokens:
            self.scheduler.finish(seq, "length")
        else:
            return False
        return True


def _host_rows(sampled: SampledTokens) -> list[tuple[int, float, float]]:
    """(token, logprob, raw logprob) per row, read from the device in one transfer."""
    stacked = torch.stack(
        [sampled.token_ids.double(), sampled.logprobs.double(), sampled.raw_logprobs.double()], 1
    )
    return [(int(token), logprob, raw) for token, logprob, raw in stacked.tolist()]
