"""Attention over the paged KV cache: a torch path for chunks, a Triton kernel for decoding.

Both read keys and values through block tables (see `libs.engine.kv_cache`), after the
caller has written the new tokens' K and V into their slots.

- `chunk_attention` (torch, any device): queries of several sequences' chunks, each chunk
  attending causally to its sequence's cache up to itself. Chunks are padded into one
  [S, Lq] x [S, Lk] batch and run through `scaled_dot_product_attention` with a mask. Used
  for prefill on every device and for decoding on CPU.
- `decode_attention` (Triton, CUDA): one query token per row, grid (rows, kv heads); each
  program loops over its row's context in tiles with an online softmax, so its cost follows
  the row's own length, and its launch shape depends on the batch size only: it can be
  captured in a CUDA graph once per batch bucket. The query heads of one KV head (GQA) go
  through the matrix units together.

    plan = AttentionPlan.build(starts, lengths, tables, block_size)   # once per forward
    out = chunk_attention(q, cache.k[layer], cache.v[layer], plan, scale)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from libs.cuda_device import on_device_of

try:  # Triton comes with CUDA builds of torch; CPU machines run the torch path only.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False


# All kernels but cuDNN's: it builds a graph for every new (batch, length) shape, and every
# prefill step has a new one (seen on an H200: prefill steps of tens of ms, as the `hf`
# engine measured for decoding; see DECODE_SDPA_BACKENDS in libs.engine.hf).
CHUNK_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


DECODE_P_IN_INPUT_DTYPE = True
"""Whether the decode kernel rounds the attention probabilities P to the cache's dtype
(bf16) before P @ V, as the kernels of the trainer's forward do (its
scaled_dot_product_attention), rather than keeping them in tf32. Closer to the trainer:
mean |sampled - trainer logprob| of qwen2-0.5b bf16 on an NVIDIA H200, 0.00983 nats with
bf16 P against 0.0103 with tf32 P on the tests' prompts (0.00899 against 0.00944 on
bench/engine_bench.py's; the hf engine 0.0082 there)."""

DECODE_TILE = 128
"""Context tokens the decode kernel takes per iteration: FlashAttention-2's key block for a
head dim of 64, so P is rounded under the same running maxima as in the trainer's forward."""

DECODE_FLASH_ORDER = True
"""Whether the decode kernel walks its context as FlashAttention-2's forward does for the
trainer (key blocks from the diagonal back to the first, the running max kept unscaled and
the scale folded into exp2, the output multiplied by 1 / sum). P is rounded to bf16 under
the running max of the tiles seen so far, so the tile boundaries and their order decide its
rounding: walked as the trainer walks, the sampled logprobs are nearest the trainer's
(bench/engine_mismatch.py, bench/results/h200/engine_mismatch.json)."""


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors that pad S chunks of a flat batch of tokens into [S, Lq] x [S, Lk].

    Built once per forward and reused by every layer. Chunks of very different lengths go
    into separate plans (see `plan_groups`), so a long prompt does not pad short ones.
    """

    query_index: torch.Tensor  # [S, Lq] int64: flat token of (chunk, i), 0 where padding
    key_slots: torch.Tensor  # [S, Lk] int64: cache slot of key position j, 0 past the context
    mask: torch.Tensor  # [S, 1, Lq, Lk] bool: may (chunk, i) attend to key j
    flat_chunk: torch.Tensor  # [n] int64: chunk of each of the plan's tokens
    flat_offset: torch.Tensor  # [n] int64: index of each of the plan's tokens in its chunk
    flat_tokens: torch.Tensor  # [n] int64: the plan's tokens in the flat batch

    @classmethod
    def build(
        cls,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        offsets: torch.Tensor | None = None,
    ) -> AttentionPlan:
        """Plan for chunks that cover positions [starts[s], starts[s] + lengths[s]) of
        sequences whose block tables are the rows of `tables` [S, W], and whose tokens start
        at `offsets[s]` in the flat batch (default: one after another from 0)."""
        device = starts.device
        ends = starts + lengths
        query_pos = torch.arange(int(lengths.max()), device=device)
        key_pos = torch.arange(int(ends.max()), device=device)
        if offsets is None:
            offsets = lengths.cumsum(0) - lengths
        is_query = query_pos[None, :] < lengths[:, None]
        query_index = torch.where(is_query, offsets[:, None] + query_pos[None, :], 0)
        is_key = key_pos[None, :] < ends[:, None]
        block_col = (key_pos // block_size).clamp(max=tables.shape[1] - 1)
        pages = tables.long().gather(1, block_col.expand(len(starts), -1))
        key_slots = torch.where(is_key, pages * block_size + key_pos % block_size, 0)
        # Causal within the sequence; a padding query (past its chunk) sees the whole
        # context, so no row of the mask is empty (an empty row would give NaN).
        absolute = starts[:, None] + query_pos[None, :]  # [S, Lq]
        mask = (key_pos[None, None, :] <= absolute[:, :, None]) & is_key[:, None, :]
        flat_chunk, flat_offset = is_query.nonzero(as_tuple=True)  # chunk order, then i
        flat_tokens = query_index[flat_chunk, flat_offset]
        return cls(query_index, key_slots, mask.unsqueeze(1), flat_chunk, flat_offset, flat_tokens)


def plan_groups(lengths: list[int]) -> list[list[int]]:
    """Chunk indices grouped by the power of two their length rounds up to (16 at least), so
    padding inside a group costs at most 2x its tokens."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        groups.setdefault(max(16, 1 << (length - 1).bit_length()), []).append(index)
    return list(groups.values())


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention output [n, H, D] of the plan's tokens (`plan.flat_tokens`) among flat
    queries `q` [N, H, D], over one layer's cache ([slots, KVH, D] each). Call it inside
    `sdpa_kernel(CHUNK_SDPA_BACKENDS)` (once per forward: entering it costs per call)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    queries = q[plan.query_index].transpose(1, 2)  # [S, H, Lq, D]
    # repeat_interleave: query head h reads KV head h // group, as transformers' repeat_kv.
    keys = k_cache[plan.key_slots].repeat_interleave(group, dim=2).transpose(1, 2)
    values = v_cache[plan.key_slots].repeat_interleave(group, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, scale=scale)
    return out.transpose(1, 2)[plan.flat_chunk, plan.flat_offset]


if HAS_TRITON:

    @triton.jit
    def _decode_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,  # [B, H, D]
        k_ptr,  # [slots, KVH, D]
        v_ptr,  # [slots, KVH, D]
        out_ptr,  # [B, H, D] (one split) or partial sums [B, H, SPLITS, D] fp32
        stats_ptr,  # [B, H, SPLITS, 2] fp32: running max and sum per split (SPLITS > 1)
        tables_ptr,  # [B, W] int32
        positions_ptr,  # [B] int64: position of the query token (context = position + 1)
        table_stride,
        scale,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        SPLITS: tl.constexpr,
        IEEE: tl.constexpr,
        P_IN_INPUT_DTYPE: tl.constexpr,
        FLASH_ORDER: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context = tl.load(positions_ptr + row).to(tl.int32) + 1
        # Split the context into SPLITS ranges of whole tiles (flash-decoding), so a few
        # long rows still fill the GPU; the ranges depend on the row's length at run time.
        split_len = tl.cdiv(tl.cdiv(context, SPLITS), TILE) * TILE
        begin = split * split_len
        end = tl.minimum(context, begin + split_len)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        is_head = heads < GROUP
        num_heads = NUM_KV_HEADS * GROUP
        head_index = kv_head * GROUP + heads
        q_offsets = (row * num_heads + head_index)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=is_head[:, None], other=0.0)
        running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        scale_log2 = scale * 1.4426950408889634  # log2(e)
        num_tiles = tl.cdiv(end - begin, TILE)
        for tile in range(0, num_tiles):
            # the last (diagonal) tile first, back to the first
            if FLASH_ORDER:  # noqa: SIM108 (constexpr branches, as the kernel's others)
                start = begin + (num_tiles - 1 - tile) * TILE
            else:
                start = begin + tile * TILE
            tokens = start + tl.arange(0, TILE)
            is_token = tokens < end
            pages = tl.load(
                tables_ptr + row * table_stride + tokens // BLOCK_SIZE, mask=is_token, other=0
            )
            slots = pages.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
            kv_offsets = (slots * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=is_token[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            if FLASH_ORDER:  # max of the raw scores, scale folded into exp2
                scores = tl.where(is_token[None, :], scores, float("-inf"))
                new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                probs = tl.exp2(scores * scale_log2 - (new_max * scale_log2)[:, None])
                rescale = tl.exp2((running_max - new_max) * scale_log2)
            else:
                scores = tl.where(is_token[None, :], scores * scale, float("-inf"))
                new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                probs = tl.exp(scores - new_max[:, None])
                rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + kv_offsets, mask=is_token[:, None], other=0.0)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
            elif P_IN_INPUT_DTYPE:  # P rounded to bf16/fp16, as flash-style kernels do
                acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
            else:  # P kept in tf32 (10-bit mantissa)
                pv = tl.dot(probs, v.to(tl.float32), input_precision="tf32")
                acc = acc * rescale[:, None] + pv
            running_max = new_max
        if SPLITS == 1:
            if FLASH_ORDER:  # noqa: SIM108 (constexpr branches, as the kernel's others)
                out = acc * (1.0 / running_sum)[:, None]
            else:
                out = acc / running_sum[:, None]
            tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])
        else:
            part = (row * num_heads + head_index) * SPLITS + split  # [GROUP_PAD]
            tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=is_head[:, None])
            if FLASH_ORDER:  # the combine takes maxima of scaled scores
                running_max = running_max * scale
            tl.store(stats_ptr + part * 2, running_max, mask=is_head)
            tl.store(stats_ptr + part * 2 + 1, running_sum, mask=is_head)

    @triton.jit
    def _combine_splits_kernel(  # type: ignore[no-untyped-def]
        partial_ptr,  # [B, H, SPLITS, D] fp32
        stats_ptr,  # [B, H, SPLITS, 2] fp32
        out_ptr,  # [B, H, D]
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row_head = tl.program_id(0)  # row * H + head
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        base = row_head * SPLITS + splits
        maxima = tl.load(stats_ptr + base * 2)
        sums = tl.load(stats_ptr + base * 2 + 1)
        top = tl.max(maxima, axis=0)
        weights = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - top))  # empty splits
        total = tl.sum(sums * weights, axis=0)
        partial = tl.load(partial_ptr + base[:, None] * HEAD_DIM + dims[None, :])
        out = tl.sum(partial * weights[:, None], axis=0) / total
        tl.store(out_ptr + row_head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def decode_splits(num_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Context splits per row so that rows x KV heads x splits fills about two waves."""
    programs = num_rows * num_kv_heads
    if programs >= num_sms:
        return 1
    return min(32, triton.next_power_of_2(-(-2 * num_sms // programs)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    splits: int = 1,
) -> torch.Tensor:
    """Attention output [B, H, D] of one query per row `q` [B, H, D] at `positions` [B],
    over the row's cache through `tables` [B, W] (int32), each row's context cut into
    `splits` ranges computed in parallel and then combined. CUDA with Triton only."""
    if not HAS_TRITON:
        raise RuntimeError("decode_attention needs Triton (a CUDA build of torch)")
    num_rows, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if splits == 1:
        partial, stats = out, out
    else:
        partial = torch.empty(
            (num_rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        stats = torch.empty((num_rows, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    with on_device_of(q):
        _launch_decode(
            q, k_cache, v_cache, (partial, stats, splits), tables, positions, scale, block_size
        )
        if splits > 1:
            _combine_splits_kernel[(num_rows * num_heads,)](
                partial, stats, out, HEAD_DIM=head_dim, SPLITS=splits
            )
    return out


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor, int],
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    block_size: int,
) -> None:
    """The decode attention kernel over (rows, KV heads, splits) `into` (partial results,
    their softmax statistics, splits; with one split the output itself)."""
    partial, stats, splits = into
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    _decode_attention_kernel[(num_rows, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        partial,
        stats,
        tables,
        positions,
        tables.stride(0),
        scale,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=DECODE_TILE,
        SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        P_IN_INPUT_DTYPE=DECODE_P_IN_INPUT_DTYPE,
        FLASH_ORDER=DECODE_FLASH_ORDER,
    )
