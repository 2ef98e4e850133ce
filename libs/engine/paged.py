"""The `paged` engine: continuous batching over a paged KV cache, decode steps as CUDA graphs.

For GPUs (it also runs, eagerly, on CPU). Every `generate` call, from any thread, adds its
sequences to one running batch: they join at the next step and leave when they finish, so
one agent's next turn starts at once instead of waiting for another call's slowest row.
`submit` does the same without waiting: it returns the call's future, which the driver
thread resolves when the call's last sequence finishes (the rollout batcher awaits it, so no
thread waits per request; a call submitted during a weight write joins after it).
One driver thread runs the steps (`libs.engine.batch_step`) while there is work (see
`libs.engine.scheduler`): admit, then one forward that decodes a token for every running
row and computes the waiting prompts beside them as extra rows of the same graph
(`libs.engine.model_runner`; a prompt of 2,048 tokens or more is prefilled eagerly, in
chunks, instead), then sample with per-row parameters and seeds (`libs.engine.row_sampling`).
The KV cache is allocated once, sized from free GPU memory, and shares prefixes (a GRPO
group's prompt, an episode's earlier turns) between sequences (`libs.engine.kv_cache`).

    engine = PagedEngine(build_policy(PolicyConfig(preset="qwen2-0.5b")), tokenizer, 256)
    completions = engine.generate([prompt_ids], SamplingParams(max_tokens=256), 16)

Or through the factory: `EngineConfig(type="paged")`; the rollout-worker takes it from
RLPIPE_ROLLOUT_WORKER_ENGINE_TYPE=paged. Models: Llama, Qwen2, Qwen3, and the mixtures of
experts Qwen3-MoE and Mixtral (others are refused).

Mixture of experts: the runner routes each token itself and records the top-k experts of
every MoE layer per KV slot, on the device, inside the decode graph
(`libs.engine.routing_table`); a finished sequence's routing is copied to the host behind
the queued work and its request resolved once the copy has landed, so no decode step waits
for it. Blocks shared from the prefix cache carry the routing recorded with their KV, and
each completion's `routed_experts` covers every position fed through the model.
`record_routing=False` turns the recording off (to measure its cost: bench/moe_engine_bench.py).

Its throughput against `hf` (bench/engine_bench.py, bench/harness_bench.py): docs/benchmarks.md.

Weights: `write_in_place` and `update_weights` wait until no call is running
(so every completion still comes from exactly one version), write into the model's own
parameter storage (the captured graphs read it), refresh the runner's fused copies, and
drop the prefix cache (its KV came from the old weights). The pause reported is that write
(7 to 12 ms for the 0.5B model on an H200). `write_between_steps` writes the same way
between two decode steps without waiting: running calls go on with the new weights, and
their completions say the version they ended on and the token each version started at
(`Completion.version_switches`).
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
from libs.engine.batch_step import BatchStepper
from libs.engine.hf import HFEngine
from libs.engine.kv_cache import BlockPool, CacheLayout, PagedKVCache, blocks_for_memory
from libs.engine.model_runner import PagedModelRunner, check_architecture
from libs.engine.requests import check_request, check_version, stage_update
from libs.engine.row_sampling import row_seed
from libs.engine.scheduler import Request, Scheduler, Sequence, blocks_needed
from libs.moe.routing import moe_shape
from libs.tokenizer import Tokenizer

CPU_KV_CACHE_TOKENS = 65_536
"""KV cache tokens on CPU when not given (allocated lazily: untouched pages cost nothing)."""
GPU_TOKENS_PER_ROW = 4096
"""On a GPU the cache holds at most this many tokens per decode row when not given."""


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
        record_routing: bool = True,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if staged_prefill_tokens < 1:
            raise ValueError(f"staged_prefill_tokens must be >= 1, got {staged_prefill_tokens}")
        check_architecture(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        layout = self._layout(block_size, kv_cache_tokens, kv_cache_memory_fraction, record_routing)
        self.cache = PagedKVCache(layout, model.device)
        self.pool = BlockPool(layout.num_blocks, block_size)
        positions = int(model.config.max_position_embeddings)
        self._max_context = min(positions, self.pool.capacity * block_size)
        self.runner = self._runner(staged_prefill_tokens, use_cuda_graphs, record_routing)
        self.scheduler = Scheduler(self.pool, max_batch_rows, prefill_chunk_tokens, policy_version)
        self._stamp = self._weights_stamp()  # parameters as the fused copies last saw them
        self._scorer = HFEngine(model, tokenizer, max_batch_rows, policy_version)
        self._lock = threading.Lock()  # the scheduler's queues, the driver, request counts
        graphs = self.runner.uses_cuda_graphs
        self.stepper = BatchStepper(
            self.runner, self.scheduler, tokenizer, self._lock, eager_prefill_above, graphs
        )
        self._changed = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step, or one weight write, at a time
        self._write_lock = threading.Lock()  # one weight write at a time
        self._num_running_calls = 0  # requests queued or running, not yet ended
        self._writing = False
        self._deferred: list[Request] = []  # submitted during a weight write
        self._ending: list[Request] = []  # ended, their routing still on its way to the host
        self._driver: threading.Thread | None = None
        # The driver's own CUDA stream, so the engine's back-to-back steps do not hold up
        # another thread's work on the default stream: the rollout-worker decodes the next
        # weight version with synchronous copies on it while generation goes on, and behind
        # a busy default stream each copy waited for the engine's queued steps.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._stream is not None:
            torch.cuda.synchronize(self.device)  # cache, rows and fused weights set up
        self._entropy = random.SystemRandom()

    def _runner(
        self, staged_prefill_tokens: int, use_cuda_graphs: bool | None, record_routing: bool
    ) -> PagedModelRunner:
        """The forward passes over this engine's cache (CUDA graphs by default on CUDA)."""
        device = self.model.device
        graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        table_width = blocks_needed(self._max_context, self.pool.block_size)
        # Graph capture and the Triton kernels' warm-up launch on the current device: make it
        # the model's (cuda:1 while the caller's is cuda:0).
        on_device = torch.cuda.device(device) if device.type == "cuda" else None
        with torch.no_grad(), on_device or contextlib.nullcontext():
            return PagedModelRunner(
                self.model,
                self.cache,
                self.max_batch_rows,
                table_width,
                graphs,
                staged_prefill_tokens,
                record_routing,
            )

    @property
    def policy_version(self) -> int:
        return self.scheduler.version

    @property
    def num_steps(self) -> int:
        return self.stepper.num_steps

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens computed (not shared from the prefix cache)."""
        return self.stepper.num_prefill_tokens

    @property
    def timings_s(self) -> dict[str, float]:
        """Seconds per phase of the steps, summed: decode_device, decode_host, prefill."""
        return self.stepper.timings_s

    @property
    def eager_prefill_above(self) -> int:
        """Prompt tokens left from which a prompt is prefilled eagerly, in chunks."""
        return self.stepper.eager_prefill_above

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
        request.version = self.scheduler.version
        self._num_running_calls += 1
        self.scheduler.waiting.extend(request.sequences)
        self._start_driver()

    def _resolve_ended(self, wait: bool = False) -> None:
        """Resolve the futures of the requests that ended, then count them out (so a weight
        write that waits for running calls starts after their futures are resolved). Called
        by the driver with no lock held: a future's callbacks run here. `scheduler.ended`
        is the driver's alone (its steps and fail_all fill it), so no lock guards it.

        A request whose routing (MoE) is still being copied to the host waits for a later
        call, after the next step is launched, unless `wait` (the driver has no step left)."""
        pending, self.scheduler.ended = self._ending + self.scheduler.ended, []
        ended: list[Request] = []
        self._ending = []
        for request in pending:
            (ended if wait or request.routing_ready() else self._ending).append(request)
        if not ended:
            return
        for request in ended:
            request.resolve()
        with self._lock:
            self._num_running_calls -= len(ended)
            self._changed.notify_all()

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        return self._write_in_place(self._copier(state), version, older=False)[1]

    def restore_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        return self._write_in_place(self._copier(state), version, older=True)[1]

    def _copier(self, state: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        staged = stage_update(self._tensors, state)  # moved and cast before the pause

        def copy() -> None:
            for name, tensor in staged.items():
                self._tensors[name].copy_(tensor)

        return copy

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return {name: tensor.detach() for name, tensor in self._tensors.items()}

    def write_in_place(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        return self._write_in_place(write, version, older=False)

    def _write_in_place(
        self, write: Callable[[], T], version: int, *, older: bool
    ) -> tuple[T, float]:
        with self._write_lock:
            with self._lock:
                if not older:
                    check_version(version, self.scheduler.version)
                self._writing = True  # new calls wait; running ones finish on the old weights
                while self._num_running_calls:
                    self._changed.wait()
            try:
                with self._step_lock, torch.no_grad():
                    result, pause_s = self._write_weights(write)
                    self.scheduler.version = version
                    return result, pause_s
            finally:
                with self._lock:
                    self._writing = False
                    deferred, self._deferred = self._deferred, []
                    for request in deferred:
                        self._enqueue(request)
                    self._changed.notify_all()

    @property
    def swaps_between_steps(self) -> bool:
        return True

    def write_between_steps(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        with self._write_lock:
            with self._lock:
                check_version(version, self.scheduler.version)
            with self._step_lock, torch.no_grad():
                result, pause_s = self._write_weights(write)
                # Running sequences record the switch at their next token; a call queued
                # meanwhile says the old version and records the new one from its first token.
                self.scheduler.version = version
                return result, pause_s

    def _write_weights(self, write: Callable[[], T]) -> tuple[T, float]:
        """Run `write` and bring the runner along (the step lock held); returns what `write`
        returned and the seconds it all took."""
        if self._stream is not None:  # the last step's trailing bookkeeping
            self._stream.synchronize()
        start_s = time.perf_counter()
        result = write()
        self.runner.refresh_weights()  # fused copies of the new parameters
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.pool.forget_all()  # cached prefixes hold the old weights' KV
        self._stamp = self._weights_stamp()
        return result, time.perf_counter() - start_s

    def score(self, prompts: list[list[int]], continuations: list[list[int]]) -> ContinuationScores:
        with self._step_lock:
            scores = self._scorer.score(prompts, continuations)
            return ContinuationScores(scores.logprobs, self.scheduler.version)

    def _layout(
        self,
        block_size: int,
        kv_cache_tokens: int | None,
        memory_fraction: float,
        record_routing: bool,
    ) -> CacheLayout:
        """The cache's shape: `kv_cache_tokens` if given, else sized from free memory, which
        the routing table (an MoE model's recorded experts, beside every slot) shares."""
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
            routing = moe_shape(self.model) if record_routing else None
            per_token = layout.bytes_per_token + (routing.bytes_per_token if routing else 0)
            num_blocks = blocks_for_memory(budget, per_token, block_size)
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
                    idle = not self.scheduler.has_work()
                    if idle and not self._ending:
                        self._driver = None
                        return
                if idle:  # no step to overlap with: wait for the routing copies
                    self._resolve_ended(wait=True)
                    continue
                try:
                    with self._step_lock, torch.no_grad():
                        self.stepper.step()
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
