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

try:  # Triton comes with CUDA builds of torch; CPU machines run the torch path only.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors that pad a flat batch of chunks ([N] tokens) into [S, Lq] x [S, Lk].

    Built once per forward and reused by every layer.
    """

    query_index: torch.Tensor  # [S, Lq] int64: flat token of (chunk, i), 0 where padding
    key_slots: torch.Tensor  # [S, Lk] int64: cache slot of key position j, 0 past the context
    mask: torch.Tensor  # [S, 1, Lq, Lk] bool: may (chunk, i) attend to key j
    flat_chunk: torch.Tensor  # [N] int64: chunk of each flat token
    flat_offset: torch.Tensor  # [N] int64: index of each flat token inside its chunk

    @classmethod
    def build(
        cls, starts: torch.Tensor, lengths: torch.Tensor, tables: torch.Tensor, block_size: int
    ) -> AttentionPlan:
        """Plan for chunks that cover positions [starts[s], starts[s] + lengths[s]) of
        sequences whose block tables are the rows of `tables` [S, W] (all on one device)."""
        device = starts.device
        ends = starts + lengths
        query_pos = torch.arange(int(lengths.max()), device=device)
        key_pos = torch.arange(int(ends.max()), device=device)
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
        flat_chunk = torch.repeat_interleave(torch.arange(len(starts), device=device), lengths)
        flat_offset = torch.arange(len(flat_chunk), device=device) - offsets[flat_chunk]
        return cls(query_index, key_slots, mask.unsqueeze(1), flat_chunk, flat_offset)


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention output [N, H, D] of flat queries `q` [N, H, D] over one layer's cache
    ([slots, KVH, D] each), as `plan` lays the chunks out."""
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
        out_ptr,  # [B, H, D]
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
        IEEE: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        context = tl.load(positions_ptr + row).to(tl.int32) + 1
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        is_head = heads < GROUP
        num_heads = NUM_KV_HEADS * GROUP
        q_offsets = (row * num_heads + kv_head * GROUP + heads)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=is_head[:, None], other=0.0)
        running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for start in range(0, context, TILE):
            tokens = start + tl.arange(0, TILE)
            is_token = tokens < context
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
            scores = tl.where(is_token[None, :], scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + kv_offsets, mask=is_token[:, None], other=0.0)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention output [B, H, D] of one query per row `q` [B, H, D] at `positions` [B],
    over the row's cache through `tables` [B, W] (int32). CUDA with Triton only."""
    if not HAS_TRITON:
        raise RuntimeError("decode_attention needs Triton (a CUDA build of torch)")
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _decode_attention_kernel[(num_rows, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        positions,
        tables.stride(0),
        scale,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=64,
        IEEE=q.dtype == torch.float32,
    )
    return out
