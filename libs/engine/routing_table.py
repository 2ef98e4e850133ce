"""The routing the `paged` engine's MoE layers chose, stored per KV-cache slot on the device.

Beside the K and V of every token slot (see `libs.engine.kv_cache`) the table holds the
top-k expert ids each MoE layer chose for the token in that slot: every forward writes them
at the same slots as its K and V (inside the CUDA graph for decode; padded rows write to
the scratch block). So routing lives and dies with the KV: a block shared by prefix reuse
carries the routing recorded when its KV was computed, and a completion whose prompt hit
the prefix cache still has routing for every position.

When a sequence finishes, `read` gathers the routing of its positions on the device and
starts a non-blocking copy to pinned host memory; the engine resolves the request once the
copy's event has passed (checked after the next step's launch, never waited for inside the
decode loop), so the copy never stalls a decode step.

    table = RoutingTable(num_moe_layers, num_slots, top_k, torch.uint8, device)
    table.write(moe_layer, slots, ids)          # in the forward, ids [N, k]
    copy = table.read(blocks, num_tokens, block_size)   # at finish
    copy.ready(); copy.result()                 # [num_tokens, L, k] on the CPU
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RoutingCopy:
    """A sequence's routing on its way to the host: ready once its copy's event passed."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._host = host
        self._event = event

    def ready(self) -> bool:
        """True once the copy has landed (always on CPU)."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        """The routing [num_tokens, L, k] in ordinary CPU memory (waits for the copy)."""
        if self._event is None:
            return self._host
        self._event.synchronize()
        return self._host.clone()  # the pinned staging memory goes back to torch's cache


class RoutingTable:
    """Expert ids [L, slots, k] of every MoE layer at every KV slot, on the cache's device."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.ids = torch.zeros((num_layers, num_slots, top_k), dtype=dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        """Routing bytes one token slot holds (all MoE layers)."""
        return self.ids.shape[0] * self.ids.shape[2] * self.ids.element_size()

    def write(self, layer: int, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """MoE layer `layer` chose experts `ids` [N, k] for the tokens in `slots` [N]."""
        self.ids[layer].index_copy_(0, slots, ids.to(self.ids.dtype))

    def read(self, blocks: Sequence[int], num_tokens: int, block_size: int) -> RoutingCopy:
        """Start copying the routing of positions [0, num_tokens) of the sequence whose block
        table is `blocks` to the host; on CUDA the copy runs behind the queued work."""
        device = self.ids.device
        table = torch.tensor(list(blocks), dtype=torch.long)
        slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]
        if device.type != "cuda":
            return RoutingCopy(self.ids[:, slots].permute(1, 0, 2).contiguous(), None)
        slots = slots.to(device, non_blocking=True)
        gathered = self.ids[:, slots].permute(1, 0, 2).contiguous()
        host = gathered.to("cpu", non_blocking=True)  # pinned (torch's host cache)
        event = torch.cuda.Event()
        event.record()
        return RoutingCopy(host, event)
