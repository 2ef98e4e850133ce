"""Router replay around the trainer's forwards on rollout tokens (MoE policies).

    tally = RoutingTally(batch)
    with replayed(model, batch, rows, config.router_replay, tally):
        logprobs = sequence_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows])
    tally.disagreement(share.total)       # fraction of token-layer pairs routed differently

When the batch carries the engine's routing (`TrainBatch.routed_experts`), every router of
the forward sends each recorded position to the experts the engine chose, with gate weights
from the trainer's own router logits over them (libs.moe.routing), so the loss and the
proximal logprobs come from the experts that produced the tokens and the router still
learns. `router_replay` None (the default) replays whenever routing is carried; False only
compares: the tally then counts the trainer's own routing against the engine's, the
disagreement replay removes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from libs.moe.routing import moe_shape, replay_routing
from libs.rl import TrainBatch


class RoutingTally:
    """Token-layer pairs of `batch` compared with the engine's routing and those whose expert
    set differed (the trainer's own choice, before replay overrides it)."""

    def __init__(self, batch: TrainBatch) -> None:
        device = batch.input_ids.device  # NCCL sums device tensors only
        self.counted = batch.routed_experts is not None  # the same on every rank
        self.differing = torch.zeros((), dtype=torch.long, device=device)
        self.compared = torch.zeros((), dtype=torch.long, device=device)

    def disagreement(self, total: Callable[[torch.Tensor], torch.Tensor]) -> float | None:
        """The fraction over every process (`total` sums over them); None: nothing compared."""
        if not self.counted:
            return None
        differing, compared = (
            float(v) for v in total(torch.stack([self.differing, self.compared]))
        )
        return differing / compared if compared else None


@contextlib.contextmanager
def replayed(
    model: PreTrainedModel,
    batch: TrainBatch,
    rows: torch.Tensor,
    router_replay: bool | None,
    tally: RoutingTally | None = None,
) -> Iterator[None]:
    """Around a forward on `rows` of `batch`: replay its recorded routing (see the module)."""
    if router_replay and moe_shape(model) is None:
        raise ValueError(
            "router_replay is on but the policy has no MoE router (Qwen3-MoE, Qwen2-MoE, "
            "Mixtral); set RLPIPE_TRAINER_ROUTER_REPLAY=false or pick an MoE policy"
        )
    if batch.routed_experts is None:
        yield
        return
    recorded = batch.routed_experts[rows]
    with replay_routing(model, recorded, replay=router_replay is not False) as trace:
        yield
    if tally is not None:
        tally.differing = tally.differing + trace.differing
        tally.compared = tally.compared + trace.compared
