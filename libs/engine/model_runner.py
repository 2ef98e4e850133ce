"""The `paged` engine's forward pass: a Llama, Qwen2/Qwen3, Qwen3-MoE or Mixtral model run
over the paged KV cache.

The transformers model keeps its modules and parameters; this runner calls its embedding,
norms, projections, MLPs and rotary embedding directly and replaces attention (by
`libs.engine.paged_attention` over `libs.engine.kv_cache`) and the mixture-of-experts blocks
(by `libs.engine.moe_layers`: the runner routes, so it records the experts each token chose
into `libs.engine.routing_table`, per KV slot, inside the decode graph too). So a weight
update written into the model's parameters in place is what the next step computes with,
and a CUDA graph captured over those same tensors stays valid.

Two entry points:
- `prefill(chunks)`: a flat batch of prompt chunks of several sequences (eager), returns the
  logits of each chunk's last token;
- `decode()`: one token for each row of `rows` (a `DecodeRows`, the running batch whose
  state lives on the device), returns logits [rows, V]. On CUDA it replays the graph
  captured for the smallest batch bucket that holds the rows; Python does no per-layer work.
  Prompt tokens staged as extra rows (`DecodeRows.stage`) are prefilled in the same replay:
  each is a query at its position over its sequence's blocks, and every layer writes all
  rows' K and V before any row attends, so a prompt's tokens see each other causally.

On CUDA the layers run fused (`libs.engine.fused_layers`: one GEMM for q/k/v and one for
gate/up, RMSNorm with the residual add, RoPE with the cache write, SiLU*up: about 10 kernels
a layer instead of 35; a Qwen3 layer's qk-norm by the same RMSNorm kernel); on CPU,
transformers' own modules (but the MoE blocks: the runner's, on every device).
`refresh_weights()` must follow every weight write (the fused projections hold copies).

Supported: model_type "llama", "qwen2", "qwen3" (qk-norm), "qwen3_moe" and "mixtral", with
full attention and the default RoPE; any other architecture is refused at construction with
the reason. MoE layers run their experts as grouped GEMMs where torch has them (CPU; CUDA in
bf16 on sm80+); elsewhere one GEMM per expert, eagerly, and then without CUDA graphs.

    runner = PagedModelRunner(model, cache, max_rows=256, table_width=512, use_cuda_graphs=True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch.nn.attention import sdpa_kernel
from transformers import PreTrainedModel

from libs.cuda_device import on_device_of
from libs.engine.fused_layers import FusedWeights, add_rmsnorm, rope_and_cache, silu_mul
from libs.engine.kv_cache import PagedKVCache
from libs.engine.moe_layers import (
    MOE_MODEL_TYPES,
    MoELayers,
    grouped_mm_available,
    moe_spec,
    torch_gated,
)
from libs.engine.paged_attention import (
    CHUNK_SDPA_BACKENDS,
    HAS_TRITON,
    AttentionPlan,
    chunk_attention,
    decode_attention,
    decode_splits,
    plan_groups,
)
from libs.engine.routing_table import RoutingTable

log = structlog.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *MOE_MODEL_TYPES)
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

Attend = Callable[[int, torch.Tensor], torch.Tensor]
"""(layer index, queries [N, H, D]) -> attention output [N, H, D]; K and V already cached."""


def check_architecture(model: PreTrainedModel) -> None:
    """Raise ValueError naming why `model` cannot run on the paged engine, if it cannot."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the paged engine runs {SUPPORTED_MODEL_TYPES} models; this one is "
            f"{config.model_type!r}: use engine type 'hf'"
        )
    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"the paged engine supports default RoPE only, not {rope_type!r}")
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):  # Qwen's configs name a window unused
        window = None
    if window is not None or any(kind != "full_attention" for kind in layer_types):
        raise ValueError("the paged engine supports full attention only (no sliding window)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of the last dimension's two halves: (a, b) -> (-b, a)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, start + len(token_ids)) of one sequence whose blocks are `blocks`."""

    token_ids: Sequence[int]
    start: int
    blocks: Sequence[int]


class DecodeRows:
    """State of the running decode batch, on the device: row i is the i-th running sequence.

    Rows [0, num_rows) decode. For one step, prompt tokens may be staged as further rows
    (`stage`): each is one query at its own position over its sequence's block table, so a
    step decodes the running rows and prefills small prompts in the same graph replay.
    Rows past those in use keep positions 0 and all-zero block tables, so the padded rows
    of a graph bucket read and write only the scratch block.
    """

    def __init__(self, max_rows: int, table_width: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.num_rows = 0
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.tables = torch.zeros((max_rows, table_width), dtype=torch.int32, device=device)
        self.temperatures = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_ps = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.num_generated = torch.zeros(max_rows, dtype=torch.long, device=device)

    def append(
        self,
        input_ids: list[int],
        positions: list[int],
        tables: Sequence[Sequence[int]],
        temperatures: list[float],
        top_ps: list[float],
        seeds: list[int],
    ) -> None:
        """Add rows (sequences that have just sampled their first token) at the end."""
        count = len(input_ids)
        assert self.num_rows + count <= self.max_rows, "the scheduler admitted more rows than fit"
        self._write(self.num_rows, input_ids, positions, tables, list(range(count)))
        self._write_sampling(self.num_rows, temperatures, top_ps, seeds, [1] * count)
        self.num_rows += count

    def stage(
        self,
        input_ids: list[int],
        positions: list[int],
        tables: Sequence[Sequence[int]],
        table_of_row: list[int],
        sampling: tuple[list[float], list[float], list[int]],
    ) -> int:
        """Write prompt tokens as rows after the running ones, for one step; row i reads
        block table `tables[table_of_row[i]]` and samples with `sampling` (temperatures,
        top-ps, seeds per row) as a first token. Returns the rows in use, staged included;
        `unstage` clears them after the step."""
        count = len(input_ids)
        start = self.num_rows
        assert start + count <= self.max_rows, "more prompt tokens staged than rows left"
        self._write(start, input_ids, positions, tables, table_of_row)
        self._write_sampling(start, *sampling, [0] * count)
        return start + count

    def unstage(self, end: int) -> None:
        """Clear the rows staged past `num_rows` (up to `end`)."""
        self.positions[self.num_rows : end] = 0
        self.tables[self.num_rows : end] = 0

    def advance(self, token_ids: torch.Tensor) -> None:
        """Every row's next input is the token it just sampled, one position further on."""
        n = self.num_rows
        self.input_ids[:n] = token_ids
        self.positions[:n] += 1
        self.num_generated[:n] += 1

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order) as rows 0.., clearing the rows left behind."""
        old = self.num_rows
        index = torch.tensor(rows, dtype=torch.long).to(self.input_ids.device, non_blocking=True)
        for buffer in self._buffers():
            buffer[: len(rows)] = buffer[index]
        self.positions[len(rows) : old] = 0
        self.tables[len(rows) : old] = 0
        self.num_rows = len(rows)

    def clear(self) -> None:
        """No rows (after a failed step)."""
        self.positions.zero_()
        self.tables.zero_()
        self.num_rows = 0

    def _write(
        self,
        start: int,
        input_ids: list[int],
        positions: list[int],
        tables: Sequence[Sequence[int]],
        table_of_row: list[int],
    ) -> None:
        """Rows [start, start + len(input_ids)): ids, positions and block tables. Only the
        tables' own width is written (the rest of a free row is zero already), and each
        distinct table crosses to the device once."""
        count, device = len(input_ids), self.input_ids.device
        rows = slice(start, start + count)
        packed = torch.tensor([input_ids, positions, table_of_row], dtype=torch.long)
        packed = packed.to(device, non_blocking=True)
        self.input_ids[rows] = packed[0]
        self.positions[rows] = packed[1]
        width = max(len(table) for table in tables)
        padded = [list(table) + [0] * (width - len(table)) for table in tables]
        distinct = torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
        self.tables[rows, :width] = distinct[packed[2]]

    def _write_sampling(
        self,
        start: int,
        temperatures: list[float],
        top_ps: list[float],
        seeds: list[int],
        num_generated: list[int],
    ) -> None:
        rows = slice(start, start + len(seeds))
        device = self.input_ids.device
        floats = torch.tensor([temperatures, top_ps], dtype=torch.float32)
        ints = torch.tensor([seeds, num_generated], dtype=torch.long)
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        self.temperatures[rows] = floats[0]
        self.top_ps[rows] = floats[1]
        self.seeds[rows] = ints[0]
        self.num_generated[rows] = ints[1]

    def _buffers(self) -> list[torch.Tensor]:
        return [
            self.input_ids,
            self.positions,
            self.tables,
            self.temperatures,
            self.top_ps,
            self.seeds,
            self.num_generated,
        ]


class PagedModelRunner:
    """Forward passes of a supported model (`check_architecture`) over a `PagedKVCache`."""

    def __init__(
        self,
        model: PreTrainedModel,
        cache: PagedKVCache,
        max_rows: int,
        table_width: int,
        use_cuda_graphs: bool,
        prefill_rows: int = 0,
        record_routing: bool = True,
    ) -> None:
        check_architecture(model)
        config = model.config
        self.model = model
        self.decoder: Any = model.model  # LlamaModel / Qwen2Model / ... (checked above)
        self.cache = cache
        self.block_size = cache.layout.block_size
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.scale = self.head_dim**-0.5
        self.device = model.device
        # Decode rows, then up to `prefill_rows` prompt tokens staged for a step beside them.
        self.prefill_rows = prefill_rows
        self.rows = DecodeRows(max_rows + prefill_rows, table_width, self.device)
        # The Triton kernel needs a power-of-two head size; otherwise decode runs in torch.
        power_of_two = self.head_dim & (self.head_dim - 1) == 0
        self.use_kernel = self.device.type == "cuda" and HAS_TRITON and power_of_two
        capacity = self.rows.max_rows
        self.buckets = [b for b in DECODE_BUCKETS if b < capacity] + [capacity]
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.eps = float(config.rms_norm_eps)
        self.fused: FusedWeights | None = None
        if self.use_kernel and getattr(config, "hidden_act", "silu") == "silu":
            self.fused = FusedWeights(self.decoder)
            positions = torch.arange(table_width * self.block_size, device=self.device)
            probe = torch.empty(1, dtype=next(model.parameters()).dtype, device=self.device)
            cos, sin = self.decoder.rotary_emb(probe, positions[None])  # as transformers
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 1
        )
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.qk_norm = hasattr(self.decoder.layers[0].self_attn, "q_norm")
        self.moe, self.routing = self._setup_moe(record_routing)
        if use_cuda_graphs and self.moe is not None and not self.moe.grouped:
            log.warning(
                "paged_engine_decodes_without_cuda_graphs",
                reason="no grouped GEMM for this device and dtype (CUDA graphs of the MoE "
                "layers need torch's grouped_mm: bf16 on sm80+); experts run one by one",
            )
            use_cuda_graphs = False
        if use_cuda_graphs:
            if not self.use_kernel:
                raise ValueError("CUDA graphs need a CUDA device with Triton")
            self._capture_graphs()

    def _setup_moe(self, record_routing: bool) -> tuple[MoELayers | None, RoutingTable | None]:
        """The MoE layers' runner and, when recording, the routing table beside the KV
        (both None for a dense model)."""
        spec = moe_spec(self.model)
        if spec is None:
            return None, None
        dtype = next(self.model.parameters()).dtype
        moe = MoELayers(spec, grouped_mm_available(self.device, dtype))
        if not record_routing:
            return moe, None
        slots = self.cache.layout.num_slots
        table = RoutingTable(
            len(spec.layers),
            slots,
            spec.top_k,
            spec.shape.dtype,
            self.device,
            staging_tokens=self.rows.max_rows,  # decode rows and staged prompt tokens
        )
        return moe, table

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs."""
        return bool(self._graphs)

    def refresh_weights(self) -> None:
        """Bring derived weights (the fused projections) up to the model's parameters."""
        if self.fused is not None:
            self.fused.refresh()

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Write the chunks' K and V into the cache; logits [len(chunks), V] of each chunk's
        last token (the next-token distribution once a chunk ends its prompt)."""
        device, size = self.device, self.block_size
        ids = [token for chunk in chunks for token in chunk.token_ids]
        positions = [chunk.start + i for chunk in chunks for i in range(len(chunk.token_ids))]
        slots = [
            chunk.blocks[(chunk.start + i) // size] * size + (chunk.start + i) % size
            for chunk in chunks
            for i in range(len(chunk.token_ids))
        ]
        lengths = torch.tensor([len(chunk.token_ids) for chunk in chunks], device=device)
        offsets = lengths.cumsum(0) - lengths
        plans = [
            self._plan([chunks[i] for i in group], offsets[group])
            for group in plan_groups([len(chunk.token_ids) for chunk in chunks])
        ]

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            k, v = self.cache.k[layer], self.cache.v[layer]
            if len(plans) == 1:
                return chunk_attention(q, k, v, plans[0], self.scale)
            out = torch.empty_like(q)
            for plan in plans:
                out[plan.flat_tokens] = chunk_attention(q, k, v, plan, self.scale)
            return out

        with sdpa_kernel(CHUNK_SDPA_BACKENDS):
            hidden = self._forward(
                torch.tensor(ids, device=device),
                torch.tensor(positions, device=device),
                torch.tensor(slots, device=device),
                attend,
            )
        last = lengths.cumsum(0) - 1
        return self._logits(hidden[last])

    def _plan(self, chunks: Sequence[PrefillChunk], offsets: torch.Tensor) -> AttentionPlan:
        """Attention plan of `chunks`, whose tokens start at `offsets` in the flat batch."""
        device, size = self.device, self.block_size
        width = max((chunk.start + len(chunk.token_ids) - 1) // size + 1 for chunk in chunks)
        tables = [
            list(chunk.blocks[:width]) + [0] * (width - len(chunk.blocks)) for chunk in chunks
        ]
        return AttentionPlan.build(
            torch.tensor([chunk.start for chunk in chunks], device=device),
            torch.tensor([len(chunk.token_ids) for chunk in chunks], device=device),
            torch.tensor(tables, device=device),
            size,
            offsets,
        )

    def decode(self, n: int | None = None) -> torch.Tensor:
        """Logits [n, V] of the next token of rows [0, n) of `self.rows` (default: the
        running rows; staged prompt rows after them give their tokens' next-token logits)."""
        n = self.rows.num_rows if n is None else n
        if self._graphs:
            bucket = next(b for b in self.buckets if b >= n)
            graph, logits = self._graphs[bucket]
            graph.replay()
            return logits[:n]
        return self._decode_logits(n)

    def _decode_logits(self, n: int) -> torch.Tensor:
        """The decode step of rows [0, n) as plain torch calls (what a graph captures)."""
        rows, size = self.rows, self.block_size
        positions, tables = rows.positions[:n], rows.tables[:n]
        pages = tables.gather(1, (positions // size).unsqueeze(1)).squeeze(1).long()
        slots = pages * size + positions % size
        if self.use_kernel:
            splits = decode_splits(n, self.num_kv_heads, self.num_sms)

            def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
                k, v = self.cache.k[layer], self.cache.v[layer]
                return decode_attention(q, k, v, tables, positions, size, self.scale, splits)

        else:
            plan = AttentionPlan.build(positions, torch.ones_like(positions), tables, size)

            def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
                k, v = self.cache.k[layer], self.cache.v[layer]
                return chunk_attention(q, k, v, plan, self.scale)

        with sdpa_kernel(CHUNK_SDPA_BACKENDS):
            hidden = self._forward(rows.input_ids[:n], positions, slots, attend)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [N, V] of final hidden states [N, hidden], in the model's dtype
        as the trainer computes them (fp32 logits out of the GEMM were measured: no gain)."""
        return self.model.lm_head(hidden)

    def _capture_graphs(self) -> None:
        """One CUDA graph of the decode step per batch bucket, largest first, one memory pool,
        captured on the engine's card (a capture runs on the current device's streams) from a
        stream of that card: torch.cuda.graph's default capture stream is made once per process
        on whichever card was current then, so a second engine on another card captured on the
        first one's stream and failed ("operation not permitted when stream is capturing")."""
        with torch.no_grad(), on_device_of(self.device):
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            for bucket in reversed(self.buckets):
                self._decode_logits(bucket)  # warm-up: Triton compiles, cuBLAS picks kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._decode_logits(bucket)
                self._graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] of flat tokens `input_ids` [N] at `positions` [N],
        whose K and V go to cache `slots` [N]; the same layer order as transformers'."""
        if self.fused is not None:
            return self._forward_fused(self.fused, input_ids, positions, slots, attend)
        hidden = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(hidden[None], positions[None])  # [1, N, D] each
        rotary = (cos[0, :, None, :], sin[0, :, None, :])
        for index, layer in enumerate(self.decoder.layers):
            normed = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(index, layer.self_attn, normed, rotary, slots, attend)
            normed = layer.post_attention_layernorm(hidden)
            moe = self._moe_slot(index)
            mlp = layer.mlp(normed) if moe is None else self._moe(moe, layer.mlp, normed, slots)
            hidden = hidden + mlp
        if self.routing is not None:
            self.routing.commit(slots)
        return self.decoder.norm(hidden)

    def _moe_slot(self, index: int) -> int | None:
        """Index of decoder layer `index` among the MoE layers; None for a dense layer."""
        return None if self.moe is None else self.moe.slot_of(index)

    def _moe(
        self, slot: int, mlp: Any, hidden: torch.Tensor, slots: torch.Tensor, fused: bool = False
    ) -> torch.Tensor:
        """MoE layer `slot` on tokens [N, hidden] in KV `slots` [N]; records their routing."""
        assert self.moe is not None
        routing = self.routing

        def record(ids: torch.Tensor) -> None:
            assert routing is not None
            routing.write(slot, slots, ids)

        gated = silu_mul if fused else functools.partial(torch_gated, mlp.experts.act_fn)
        return self.moe.forward(mlp, hidden, gated, None if routing is None else record)

    def _forward_fused(
        self,
        fused: FusedWeights,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """`_forward` with the fused kernels (CUDA): each layer's output stays a pending
        `delta` that the next RMSNorm adds into `hidden` in the same kernel."""
        hidden = self.decoder.embed_tokens(input_ids)
        n = hidden.shape[0]
        delta: torch.Tensor | None = None
        for index, layer in enumerate(self.decoder.layers):
            normed = add_rmsnorm(hidden, delta, layer.input_layernorm.weight, self.eps)
            qkv = torch.nn.functional.linear(normed, fused.qkv_weight[index], fused.qkv_bias[index])
            if self.qk_norm:
                qkv = self._qk_norm(layer.self_attn, qkv)
            k_cache, v_cache = self.cache.k[index], self.cache.v[index]
            q = rope_and_cache(
                qkv, self.cos, self.sin, positions, slots, k_cache, v_cache, self.num_heads
            )
            delta = layer.self_attn.o_proj(attend(index, q).reshape(n, -1))
            normed = add_rmsnorm(hidden, delta, layer.post_attention_layernorm.weight, self.eps)
            gate_up_weight, moe = fused.gate_up_weight[index], self._moe_slot(index)
            if moe is not None:
                delta = self._moe(moe, layer.mlp, normed, slots, fused=True)
            else:
                assert gate_up_weight is not None
                gate_up = torch.nn.functional.linear(normed, gate_up_weight)
                delta = layer.mlp.down_proj(silu_mul(gate_up))
        if self.routing is not None:
            self.routing.commit(slots)
        return add_rmsnorm(hidden, delta, self.decoder.norm.weight, self.eps)

    def _qk_norm(self, attention: Any, qkv: torch.Tensor) -> torch.Tensor:
        """`qkv` [N, (H + 2 KVH) D] with q and k RMS-normalised per head before RoPE (Qwen3's
        qk-norm: the fused RMSNorm over rows of one head, [N H, D])."""
        n, dim = qkv.shape[0], self.head_dim
        q_end = self.num_heads * dim
        k_end = q_end + self.num_kv_heads * dim
        q_norm, k_norm = attention.q_norm, attention.k_norm
        q = qkv[:, :q_end].reshape(-1, dim)  # a copy: rows of one head, contiguous
        k = qkv[:, q_end:k_end].reshape(-1, dim)
        q = add_rmsnorm(q, None, q_norm.weight, q_norm.variance_epsilon).view(n, -1)
        k = add_rmsnorm(k, None, k_norm.weight, k_norm.variance_epsilon).view(n, -1)
        return torch.cat([q, k, qkv[:, k_end:]], dim=1)

    def _attention(
        self,
        index: int,
        attention: Any,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """One layer's self-attention of flat tokens [N, hidden]: project, rotate, cache, attend."""
        n, cos, sin = hidden.shape[0], rotary[0], rotary[1]
        q = attention.q_proj(hidden).view(n, -1, self.head_dim)
        k = attention.k_proj(hidden).view(n, -1, self.head_dim)
        v = attention.v_proj(hidden).view(n, -1, self.head_dim)
        if self.qk_norm:
            q, k = attention.q_norm(q), attention.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.cache.k[index].index_copy_(0, slots, k)
        self.cache.v[index].index_copy_(0, slots, v)
        out = attend(index, q)
        return attention.o_proj(out.reshape(n, -1))
