"""An episode's MoE routing laid onto its turns (router replay, libs.moe).

    routing = EpisodeRouting()
    routing.add(segment, completion.routed_experts)   # after each engine call of a segment
    routing.attach(turns)                              # each turn's positions, compressed

Each engine call reports the routing of every position it fed: the segment's context so far
(its prompt) and the completion but its last token. A position keeps the routing of the call
that first fed it, as a prefix-caching engine keeps the routing stored with the cached KV;
the hf engine computes the prompt again, and its later routing of the same positions is
dropped (it differs only where the weights changed between the turns). The episode's last
sampled token is never fed, so its turn's record stops one token short.
"""

from __future__ import annotations

import torch
from prometheus_client import Gauge

from libs.moe.routing import extend_routing
from libs.moe.wire import encode_routing, routing_bytes
from proto.messages import Turn

ROUTING_RAW_BYTES_PER_TOKEN = Gauge(
    "rlpipe_rollout_routing_raw_bytes_per_token",
    "MoE routing recorded per token, before compression (L x k small ints), over all rollouts",
)
ROUTING_WIRE_BYTES_PER_TOKEN = Gauge(
    "rlpipe_rollout_routing_wire_bytes_per_token",
    "MoE routing per token on the wire (zstd), over all rollouts",
)


class RoutingSize:
    """Routing bytes carried so far by this process's rollouts, raw and on the wire."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.raw_bytes = 0
        self.wire_bytes = 0

    def add(self, num_tokens: int, raw_bytes: int, wire_bytes: int) -> None:
        self.num_tokens += num_tokens
        self.raw_bytes += raw_bytes
        self.wire_bytes += wire_bytes
        if self.num_tokens:
            ROUTING_RAW_BYTES_PER_TOKEN.set(self.raw_bytes / self.num_tokens)
            ROUTING_WIRE_BYTES_PER_TOKEN.set(self.wire_bytes / self.num_tokens)


ROUTING_SIZE = RoutingSize()


class EpisodeRouting:
    """Per context segment, the routing [n, L, k] of its first n positions."""

    def __init__(self) -> None:
        self._segments: dict[int, torch.Tensor] = {}

    def add(self, segment: int, routed: torch.Tensor | None) -> None:
        """Keep the positions `routed` (an engine call's [P + G - 1, L, k]) adds."""
        extended = extend_routing(self._segments.get(segment), routed)
        if extended is not None:
            self._segments[segment] = extended

    def attach(self, turns: list[Turn], size: RoutingSize = ROUTING_SIZE) -> None:
        """Set each turn's `routed_experts` to its tokens' routing (turns in episode order)."""
        offsets: dict[int, int] = {}
        for turn in turns:
            routed = self._segments.get(turn.segment)
            start = offsets.get(turn.segment, 0)
            offsets[turn.segment] = start + len(turn.token_ids)
            if routed is None or start >= routed.shape[0]:
                continue
            turn.routed_experts = encode_routing(routed[start : start + len(turn.token_ids)])
            size.add(turn.routed_experts.num_tokens, *routing_bytes(turn.routed_experts))
