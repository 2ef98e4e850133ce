"""Fused Triton kernels for the elementwise parts of a Llama/Qwen2 layer (CUDA only).

Decoding a 0.5B model is launch-bound: in transformers' modules one layer is about 35
kernels (an RMSNorm alone is seven), and at 64 rows each costs more in launch than in work.
These kernels do the same arithmetic in fewer launches, rounding where torch rounds (every
bf16 intermediate that transformers materializes is rounded to bf16 here too), so the
result matches the modules' up to the order of a sum:

- `add_rmsnorm`: residual add (hidden += delta, rounded to the model dtype) + RMSNorm;
- `rope_and_cache`: RoPE on q and k from the fused qkv projection, k and v written to
  their cache slots, q returned;
- `silu_mul`: SiLU(gate) * up from the fused gate/up projection.

Every launch passes `enable_fp_fusion=False`: Triton otherwise contracts a multiply and the
add after it into one FMA across the bf16 rounding between them, and RoPE then differs
from transformers' by an ulp in many elements; without the contraction all three kernels are
bitwise equal to transformers' ops.

`FusedWeights` holds the concatenated qkv and gate/up weights the fused projections use (a
mixture-of-experts layer has no gate/up of its own: its experts' weights are fused already).
They are copies of the model's own parameters, so `refresh()` must run after every weight
write (the engine does this inside the write's pause; it copies into the same storage, so
captured CUDA graphs stay valid).

    weights = FusedWeights(model)
    normed = add_rmsnorm(hidden, delta, layer.input_layernorm.weight, eps)  # hidden updated
"""

from __future__ import annotations

from typing import Any

import torch

from libs.cuda_device import on_device_of
from libs.engine.paged_attention import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rmsnorm_kernel(  # type: ignore[no-untyped-def]
        hidden_ptr,  # [N, C], updated in place when HAS_DELTA
        delta_ptr,  # [N, C]
        weight_ptr,  # [C]
        out_ptr,  # [N, C]
        num_cols,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        valid = cols < num_cols
        offsets = row * num_cols + cols
        x = tl.load(hidden_ptr + offsets, mask=valid, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + offsets, mask=valid, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(hidden_ptr.dtype.element_ty)
            tl.store(hidden_ptr + offsets, x, mask=valid)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / num_cols
        normed = (xf * tl.rsqrt(variance + eps)).to(hidden_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=valid, other=0.0)
        out = weight.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _rope_and_cache_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr,  # [N, (H + 2 KVH) * D]
        cos_ptr,  # [positions, D], model dtype
        sin_ptr,
        positions_ptr,  # [N] int64
        slots_ptr,  # [N] int64
        q_ptr,  # [N, H, D] out
        k_cache_ptr,  # [slots, KVH, D]
        v_cache_ptr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, HEAD_DIM)
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        source = qkv_ptr + token * width + head * HEAD_DIM
        x = tl.load(source + dims)
        slot = tl.load(slots_ptr + token)
        if head < NUM_HEADS + NUM_KV_HEADS:
            half = HEAD_DIM // 2
            partner = tl.load(source + (dims + half) % HEAD_DIM)
            rotated = tl.where(dims < half, -partner, partner)  # rotate_half
            position = tl.load(positions_ptr + token)
            cos = tl.load(cos_ptr + position * HEAD_DIM + dims).to(tl.float32)
            sin = tl.load(sin_ptr + position * HEAD_DIM + dims).to(tl.float32)
            dtype = qkv_ptr.dtype.element_ty
            a = (x.to(tl.float32) * cos).to(dtype)  # q * cos, rounded as torch does
            b = (rotated.to(tl.float32) * sin).to(dtype)  # rotate_half(q) * sin
            y = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
            if head < NUM_HEADS:
                tl.store(q_ptr + (token * NUM_HEADS + head) * HEAD_DIM + dims, y)
            else:
                kv_head = head - NUM_HEADS
                tl.store(k_cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims, y)
        else:
            kv_head = head - NUM_HEADS - NUM_KV_HEADS
            tl.store(v_cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims, x)

    @triton.jit
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        gate_up_ptr,  # [N, 2 I]: gate then up
        out_ptr,  # [N, I]
        inner,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < inner
        gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=valid, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=valid, other=0.0)
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu, rounded
        out = activated.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


def add_rmsnorm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of `hidden` [N, C] (after `hidden += delta` in place, when given)."""
    out = torch.empty_like(hidden)
    num_cols = hidden.shape[1]
    with on_device_of(hidden):
        _add_rmsnorm_kernel[(hidden.shape[0],)](
            hidden,
            hidden if delta is None else delta,
            weight,
            out,
            num_cols,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(num_cols),
            enable_fp_fusion=False,  # bitwise as torch: see the module docstring
        )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Rotated queries [N, H, D] from `qkv` [N, (H + 2 KVH) D]; rotated keys and the values
    are written to the cache at `slots` [N]."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    q = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    with on_device_of(qkv):
        _rope_and_cache_kernel[(qkv.shape[0], num_heads + 2 * num_kv_heads)](
            qkv,
            cos,
            sin,
            positions,
            slots,
            q,
            k_cache,
            v_cache,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            enable_fp_fusion=False,  # bitwise as torch: see the module docstring
        )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `gate_up` [N, 2 I] (gate first): [N, I]."""
    inner = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inner), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    with on_device_of(gate_up):
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inner, block))](
            gate_up, out, inner, BLOCK=block, enable_fp_fusion=False
        )
    return out


class FusedWeights:
    """Per layer, the q/k/v and gate/up weights concatenated (one GEMM each), refreshable."""

    def __init__(self, decoder: Any) -> None:
        self._decoder = decoder
        self.qkv_weight: list[torch.Tensor] = []
        self.qkv_bias: list[torch.Tensor | None] = []
        self.gate_up_weight: list[torch.Tensor | None] = []
        with torch.no_grad():
            for layer in decoder.layers:
                attention, mlp = layer.self_attn, layer.mlp
                projections = (attention.q_proj, attention.k_proj, attention.v_proj)
                self.qkv_weight.append(torch.cat([p.weight for p in projections]))
                biases = [p.bias for p in projections]
                has_bias = all(b is not None for b in biases)
                self.qkv_bias.append(torch.cat(biases) if has_bias else None)
                dense = hasattr(mlp, "gate_proj")
                self.gate_up_weight.append(
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) if dense else None
                )

    def refresh(self) -> None:
        """Copy the model's current parameters into the fused tensors (same storage)."""
        with torch.no_grad():
            for index, layer in enumerate(self._decoder.layers):
                attention, mlp = layer.self_attn, layer.mlp
                projections = (attention.q_proj, attention.k_proj, attention.v_proj)
                torch.cat([p.weight for p in projections], out=self.qkv_weight[index])
                bias = self.qkv_bias[index]
                if bias is not None:
                    torch.cat([p.bias for p in projections], out=bias)
                gate_up = self.gate_up_weight[index]
                if gate_up is not None:
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=gate_up)
