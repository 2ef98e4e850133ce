"""The routing the `paged` engine's MoE layers chose, stored per KV-cache slot on the device.

Beside the K and V of every token slot (see `libs.engine.kv_cache`) the table holds the
top-k expert ids each MoE layer chose for the token in that slot: every forward writes them
at the same slots as its K and V, staged per layer and scattered once after the last layer
(inside the CUDA graph for decode; padded rows write to the scratch block). So routing
lives and dies with the KV: a block shared by prefix reuse carries the routing recorded
when its KV was computed, and a completion whose prompt hit the prefix cache still has
routing for every position.

When sequences finish, `read` gathers the routing of all their positions on the device in
one gather and starts one non-blocking copy to pinned host memory (a copy per sequence cost
a dozen launches each: 256 rows finishing on one step paid them 256 times); the engine
resolves a request once the copy's event has passed (checked after the next step's launch,
never waited for inside the decode loop), so the copy never stalls a decode step.

    table = RoutingTable(num_moe_layers, num_slots, top_k, torch.uint8, device)
    table.write(moe_layer, slots, ids)          # in the forward, ids [N, k]
    table.commit(slots)                         # after its last layer
    copies = table.read([(blocks, num_tokens), ...], block_size)   # at finish
    copies[0].ready(); copies[0].result()       # [num_tokens, L, k] on the CPU
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from libs.cuda_device import recorded_event


class RoutingCopy:
    """A sequence's routing on its way to the host: rows [start, stop) of a copy that several
    sequences share, ready once the copy's event passed."""

    def __init__(
        self, host: torch.Tensor, event: torch.cuda.Event | None, start: int, stop: int
    ) -> None:
        self._host = host
        self._event = event
        self._rows = slice(start, stop)

    def ready(self) -> bool:
        """True once the copy has landed (always on CPU)."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        """The routing [num_tokens, L, k] in ordinary CPU memory (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        # A copy of its own: the shared (pinned) staging memory goes back to torch's cache
        # once every sequence of the read has taken its rows.
        return self._host[self._rows].clone()


class RoutingTable:
    """Expert ids [L, slots, k] of every MoE layer at every KV slot, on the cache's device."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        staging_tokens: int = 256,
    ) -> None:
        self.ids = torch.zeros((num_layers, num_slots, top_k), dtype=dtype, device=device)
        # A forward's experts of every layer before `commit` (decode rows and staged prompt
        # chunks fit: the runner sizes it by them).
        self._staged = torch.zeros((num_layers, staging_tokens, top_k), dtype=dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        """Routing bytes one token slot holds (all MoE layers)."""
        return self.ids.shape[0] * self.ids.shape[2] * self.ids.element_size()

    def write(self, layer: int, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """MoE layer `layer` chose experts `ids` [N, k] for the tokens in `slots` [N]: staged
        (one copy, converting to the table's dtype) until `commit` scatters every layer's at
        once; a forward of more tokens than the staging holds writes the table directly."""
        n = ids.shape[0]
        if n <= self._staged.shape[1]:
            self._staged[layer, :n].copy_(ids)
        else:
            self.ids[layer].index_copy_(0, slots, ids.to(self.ids.dtype))

    def commit(self, slots: torch.Tensor) -> None:
        """The forward over tokens in `slots` [N] has staged every layer's experts: one
        scatter into the table (a scatter per layer made each decode graph 16 nodes longer
        on moe-1b, and a graph's launch costs the host time per node)."""
        n = slots.shape[0]
        if n <= self._staged.shape[1]:
            self.ids.index_copy_(1, slots, self._staged[:, :n])

    def read(
        self, sequences: Sequence[tuple[Sequence[int], int]], block_size: int
    ) -> list[RoutingCopy]:
        """Start copying, for each (block table, num_tokens) of `sequences`, the routing of
        positions [0, num_tokens) to the host, all in one gather and one copy; on CUDA the
        copy runs behind the queued work."""
        if not sequences:
            return []
        offsets = np.arange(block_size)
        per_sequence = [
            (np.asarray(blocks, dtype=np.int64)[:, None] * block_size + offsets).reshape(-1)[:n]
            for blocks, n in sequences
        ]
        bounds = np.cumsum([0] + [len(slots) for slots in per_sequence]).tolist()
        slots = torch.from_numpy(np.concatenate(per_sequence))
        device = self.ids.device
        event: torch.cuda.Event | None = None
        if device.type == "cuda":
            slots = slots.pin_memory().to(device, non_blocking=True)
            gathered = self.ids[:, slots].permute(1, 0, 2).contiguous()
            host = gathered.to("cpu", non_blocking=True)  # pinned (torch's host cache)
            event = recorded_event(device)
        else:
            host = self.ids[:, slots].permute(1, 0, 2).contiguous()
        return [
            RoutingCopy(host, event, bounds[i], bounds[i + 1]) for i in range(len(per_sequence))
        ]
