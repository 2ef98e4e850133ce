"""Mixture-of-experts layers of the `paged` engine: the router and the experts, computed by the
runner itself so that it can record the routing (Qwen3-MoE and Mixtral layer shapes).

The arithmetic is transformers' `grouped_mm` experts forward (the implementation its MoE
models use by default, so the trainer's): the router's softmax in fp32, top-k, renormalised
(Qwen3-MoE when `norm_topk_prob`, Mixtral always) and, for Qwen3-MoE, cast to the model's
dtype; each (token, slot) pair through its expert's gate/up and down projections; the
outputs weighted, put back in (token, slot) order and summed over the slots (in fp32, then
rounded once).

Two ways to run the experts, equal up to the GEMMs' summation order:
- `experts_grouped`: the pairs sorted by expert and two grouped GEMMs (`torch.nn.functional.
  grouped_mm`) whose group offsets are counted on the device: static shapes, no host sync,
  so a CUDA graph can capture it (bf16 on sm80+; any float dtype on CPU);
- `experts_looped`: one GEMM per expert hit (it reads the hits on the host): the fallback
  where grouped GEMMs are not available, eager only.

The weights are the model's own parameters (`mlp.gate.weight`, `mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]), read at every call: a weight write in place
is what the next step computes, and a captured graph keeps reading the same storage.

    spec = moe_spec(model)                          # None for a dense model
    weights, ids = route(hidden, mlp.gate.weight, spec)
    out = experts_grouped(hidden, ids, weights, mlp.experts, gated)
    layers = MoELayers(spec, grouped=grouped_mm_available(device, dtype))  # the runner's
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from libs.moe.routing import MoEShape

Gated = Callable[[torch.Tensor], torch.Tensor]
"""act(gate) * up of a gate/up projection [S, 2I] (gate first): [S, I]."""

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoESpec:
    """How a model routes: experts, top-k, the router's rounding, which layers are MoE."""

    num_experts: int
    top_k: int
    normalize: bool
    """Renormalise the top-k probabilities to sum to 1."""
    weights_in_model_dtype: bool
    """Cast the routing weights to the model's dtype (Qwen3-MoE) or keep them in fp32 (Mixtral)."""
    layers: tuple[int, ...]
    """Indices of the decoder layers whose MLP is a mixture of experts, ascending."""

    @property
    def shape(self) -> MoEShape:
        """The routing recorded per token (L x k ids, their dtype and bytes), as
        `libs.moe.routing` records it for the trainer."""
        return MoEShape(len(self.layers), self.top_k, self.num_experts)


def moe_spec(model: Any) -> MoESpec | None:
    """The routing of `model` (a Qwen3-MoE or Mixtral causal LM); None for a dense model."""
    config = model.config
    if config.model_type not in MOE_MODEL_TYPES:
        return None
    layers = tuple(
        index
        for index, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")
    )
    if not layers:
        return None
    mixtral = config.model_type == "mixtral"
    return MoESpec(
        num_experts=int(config.num_local_experts if mixtral else config.num_experts),
        top_k=int(config.num_experts_per_tok),
        normalize=True if mixtral else bool(config.norm_topk_prob),
        weights_in_model_dtype=not mixtral,
        layers=layers,
    )


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, spec: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [N, k] and expert ids [N, k] (int64, top-k order) of tokens [N, H]."""
    logits = F.linear(hidden, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    if spec.weights_in_model_dtype:
        top = top.to(logits.dtype)
    return top, ids


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `experts_grouped` runs here: torch's grouped GEMM on CPU, or on CUDA in bf16
    (sm80+ for `torch.nn.functional.grouped_mm`, sm90 for the older `torch._grouped_mm`)."""
    public = hasattr(F, "grouped_mm")
    if not public and not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return public
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8 if public else major == 9


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] (rows grouped by expert, group e ending at offsets[e]) @ weight[e].T per group,
    weight [E, N, K]: [S, N]."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, weight.transpose(-2, -1), offs=offsets)


def experts_grouped(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Any, gated: Gated
) -> torch.Tensor:
    """The experts' output [N, H] for tokens `hidden` [N, H] routed to `ids` [N, k] with
    `weights` [N, k]: two grouped GEMMs over the pairs sorted by expert (graph-capturable)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert
    counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    x = hidden[order // k]
    y = _grouped_mm(
        gated(_grouped_mm(x, experts.gate_up_proj, offsets)), experts.down_proj, offsets
    )
    out = torch.empty_like(y).index_copy_(0, order, y)  # back in (token, slot) order
    return _combine(out, weights, n, k, hidden.dtype)


def experts_looped(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Any, gated: Gated
) -> torch.Tensor:
    """`experts_grouped` as one GEMM per expert hit (reads the hits on the host: eager only)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    out = hidden.new_empty((n * k, hidden.shape[1]))
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        up = F.linear(hidden[pairs // k], experts.gate_up_proj[expert])
        out[pairs] = F.linear(gated(up), experts.down_proj[expert]).to(out.dtype)
    return _combine(out, weights, n, k, hidden.dtype)


def _combine(
    out: torch.Tensor, weights: torch.Tensor, n: int, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pair outputs [N k, H] weighted and summed over each token's k slots: [N, H]."""
    weighted = out * weights.reshape(-1, 1)
    return weighted.view(n, k, -1).sum(dim=1).to(dtype)


def torch_gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up in torch, `act` the experts' own activation (as transformers computes
    it; the fused path has a kernel for SiLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class MoELayers:
    """Runs a model's MoE layers: route, record (optional), experts."""

    def __init__(self, spec: MoESpec, grouped: bool) -> None:
        self.spec = spec
        self.grouped = grouped
        self._slot = {layer: slot for slot, layer in enumerate(spec.layers)}

    def slot_of(self, layer: int) -> int | None:
        """Position of decoder layer `layer` among the MoE layers; None for a dense one."""
        return self._slot.get(layer)

    def forward(
        self,
        mlp: Any,
        hidden: torch.Tensor,
        gated: Gated,
        record: Callable[[torch.Tensor], None] | None,
    ) -> torch.Tensor:
        """The MoE block `mlp` on tokens `hidden` [N, H]; `record` gets the expert ids [N, k]."""
        weights, ids = route(hidden, mlp.gate.weight, self.spec)
        if record is not None:
            record(ids)
        run = experts_grouped if self.grouped else experts_looped
        return run(hidden, ids, weights, mlp.experts, gated)
