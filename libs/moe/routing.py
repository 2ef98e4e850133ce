"""Mixture-of-experts routing: which experts each token went to, recorded and replayed.

In an MoE a tiny numerical difference between the inference engine and the trainer can
flip which experts a token goes to; the trainer then updates experts that never produced
the token. So the engine records the experts every router chose (small ints, top-k per
position per MoE layer) and the trainer replays them (router replay):

    shape = moe_shape(model)                     # None for a dense model
    with record_routing(model) as recorder:      # every router's top-k during forwards
        model(input_ids=ids)                     # ids [B, T]
    routed = recorder.take(batch_size=B)         # [B, T, L, k] in shape.dtype
    with replay_routing(model, recorded) as trace:   # recorded [B, T, L, k], -1: no record
        logprobs = sequence_logprobs(model, ids, mask)
    trace.counts()                               # token-layer pairs whose expert set differs

The seam is the router module (`mlp.gate`: Qwen3MoeTopKRouter, Qwen2MoeTopKRouter,
MixtralTopKRouter), whose forward takes hidden states flattened to [B * T, H] in row-major
order and returns (logits [N, E], gate weights [N, k], expert ids [N, k]). Replay keeps the
router's own logits and swaps its choice for the recorded experts, with gate weights
recomputed from those logits over the recorded experts exactly as the family does (softmax,
gather, renormalise when it does), so gradients still reach the router; positions without a
record keep the router's own top-k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

NOT_RECORDED = -1
"""Entry of a replayed routing tensor at a position with no record (prompt positions the
engine did not report, padding): that position keeps the trainer's own choice."""


@dataclass(frozen=True)
class _Family:
    """How a router family turns its logits into gate weights over the chosen experts."""

    normalizes: Callable[[nn.Module], bool]
    casts_to_logits_dtype: bool


# Checked against transformers 5.x: the Qwen MoE routers renormalise when `norm_topk_prob`
# and return weights in the logits' dtype; Mixtral always renormalises and keeps fp32.
ROUTER_FAMILIES: dict[str, _Family] = {
    "Qwen3MoeTopKRouter": _Family(lambda r: bool(r.norm_topk_prob), casts_to_logits_dtype=True),
    "Qwen2MoeTopKRouter": _Family(lambda r: bool(r.norm_topk_prob), casts_to_logits_dtype=True),
    "MixtralTopKRouter": _Family(lambda r: True, casts_to_logits_dtype=False),
}


@dataclass(frozen=True)
class MoEShape:
    """The routing a model makes per token: `num_layers` routers choose `top_k` of
    `num_experts` experts each."""

    num_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        """The smallest int holding an expert id: uint8 up to 256 experts, else int16."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    @property
    def bytes_per_token(self) -> int:
        """Raw routing bytes of one position: L x k ids."""
        return self.num_layers * self.top_k * self.dtype.itemsize


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's router modules, in layer order (empty for a dense model)."""
    return [module for module in model.modules() if type(module).__name__ in ROUTER_FAMILIES]


def moe_shape(model: nn.Module) -> MoEShape | None:
    """The routing shape of `model`; None when it has no router of a supported family."""
    found = routers(model)
    if not found:
        return None
    top_ks = {int(getattr(router, "top_k")) for router in found}  # noqa: B009 (Module attrs)
    experts = {int(getattr(router, "num_experts")) for router in found}  # noqa: B009
    if len(top_ks) != 1 or len(experts) != 1:
        raise ValueError(
            f"MoE layers differ in top_k {sorted(top_ks)} or experts {sorted(experts)}: "
            "routing is recorded as one [L, k] block per token, so every layer must match"
        )
    return MoEShape(len(found), top_ks.pop(), experts.pop())


def extend_routing(kept: torch.Tensor | None, routed: torch.Tensor | None) -> torch.Tensor | None:
    """`kept` [n, L, k] followed by the positions past n of `routed` [m, L, k], an engine call
    over the same sequence continued: a position keeps the routing of the call that first
    fed it (as a prefix-caching engine keeps the routing stored with the cached KV)."""
    if kept is None or routed is None:
        return routed if kept is None else kept
    if routed.shape[0] <= kept.shape[0]:
        return kept
    return torch.cat([kept, routed[kept.shape[0] :]])


def gate_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Gate weights [N, k] of `experts` [N, k] from router `logits` [N, E], as the router's
    family computes them for its own top-k (differentiable in `logits`)."""
    family = ROUTER_FAMILIES[type(router).__name__]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, experts)
    if family.normalizes(router):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if family.casts_to_logits_dtype else weights


@dataclass
class RoutingRecorder:
    """Expert ids each router chose, per forward, in the order forwards ran."""

    shape: MoEShape
    _calls: list[list[torch.Tensor]] = field(default_factory=list)

    def on_router(self, layer: int, indices: torch.Tensor) -> None:
        if layer == 0:
            self._calls.append([])
        self._calls[-1].append(indices.detach().to(self.shape.dtype))

    def take(self, batch_size: int) -> torch.Tensor:
        """The newest forward's routing [B, T, L, k] (its [B * T] rows split into B rows), on
        the model's device, forgotten after."""
        assert self._calls, "no forward ran since the last take"
        per_layer = self._calls.pop()
        assert len(per_layer) == self.shape.num_layers, "a forward skipped a router"
        stacked = torch.stack(per_layer, dim=1)  # [B * T, L, k]
        self._calls.clear()
        return stacked.view(batch_size, -1, self.shape.num_layers, self.shape.top_k)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record every router's expert ids during the forwards run inside."""
    shape = moe_shape(model)
    if shape is None:
        raise ValueError("record_routing needs an MoE model (no supported router found)")
    recorder = RoutingRecorder(shape)

    def hook(layer: int) -> Callable[..., None]:
        def on_forward(_module: nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
            recorder.on_router(layer, output[2])

        return on_forward

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers(model))]
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class ReplayTrace:
    """What the routers chose on their own at recorded positions, against the record
    (counts kept as tensors on the model's device: no host sync per layer)."""

    differing: torch.Tensor | int = 0
    """Token-layer pairs whose own expert set differs from the recorded one."""
    compared: torch.Tensor | int = 0
    """Token-layer pairs with a record."""

    def add(self, own: torch.Tensor, recorded: torch.Tensor, has_record: torch.Tensor) -> None:
        same = (own.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
        self.differing = self.differing + (~same & has_record).sum()
        self.compared = self.compared + has_record.sum()

    @property
    def disagreement(self) -> float | None:
        """Fraction of compared pairs that differ; None when none had a record."""
        compared = int(self.compared)
        return int(self.differing) / compared if compared else None


@contextlib.contextmanager
def replay_routing(
    model: nn.Module, recorded: torch.Tensor, *, replay: bool = True
) -> Iterator[ReplayTrace]:
    """Inside, every forward over a [B, T] batch routes position (b, t) of MoE layer l to
    `recorded[b, t, l]` (any int dtype, NOT_RECORDED rows keep the router's own top-k) with
    the router's own gate weights over those experts; `replay=False` only compares (the
    trace counts the routers' own disagreement with the record either way)."""
    shape = moe_shape(model)
    if shape is None:
        raise ValueError("router replay needs an MoE model; set router_replay to false")
    expected = (shape.num_layers, shape.top_k)
    if recorded.dim() != 4 or tuple(recorded.shape[2:]) != expected:
        raise ValueError(f"recorded routing {tuple(recorded.shape)} is not [B, T, L, k] {expected}")
    trace = ReplayTrace()
    # Rows in the routers' [B * T] order, as int64 on the routers' device once for every
    # layer (not a copy and a cast per layer and forward).
    device = next(routers(model)[0].parameters()).device
    flat = recorded.to(device, torch.long).reshape(-1, *expected)
    handles = [
        router.register_forward_hook(_replay_hook(trace, flat[:, layer], replay))
        for layer, router in enumerate(routers(model))
    ]
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(trace: ReplayTrace, recorded: torch.Tensor, replay: bool) -> Callable[..., object]:
    """The forward hook of one router, given its layer's `recorded` ids [B * T, k]."""

    def on_forward(
        router: nn.Module, _args: object, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        logits, _weights, own = output
        if own.shape[0] != recorded.shape[0]:
            raise ValueError(
                f"a router saw {own.shape[0]} positions but the recorded routing has "
                f"{recorded.shape[0]}: replay needs the recorded tensor of this exact batch"
            )
        ids = recorded.to(own.device)  # a no-op unless a router sits on another device
        # An id past the router's experts (a corrupt or forged record) counts as no record:
        # that position keeps the router's own choice instead of failing the whole step.
        has_record = ((ids >= 0) & (ids < logits.shape[-1])).all(dim=-1)
        trace.add(own, ids, has_record)
        if not replay:
            return None
        chosen = torch.where(has_record.unsqueeze(-1), ids, own)
        return logits, gate_weights(router, logits, chosen), chosen

    return on_forward
