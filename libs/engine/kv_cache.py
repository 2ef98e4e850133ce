"""The paged KV cache of the `paged` engine: fixed tensors and the block pool that lends them.

The cache is allocated once, when the engine starts, and never reallocated: per layer one
K and one V tensor of `num_blocks * block_size` token slots. A sequence owns a list of
blocks (its block table); token t of it lives in slot `table[t // block_size] * block_size +
t % block_size`. Block 0 is never lent: padded rows of a CUDA-graph batch write there.

Prefix sharing: a full block whose tokens (and every token before them) are known is
registered under a key (the content id of the block before it, its tokens). A new sequence
walks its prompt block by block through these keys and shares every block it finds (its
refcount goes up) instead of computing that KV again: the samples of a GRPO group share
their prompt, and an episode's next turn shares its earlier turns. A block nobody uses but
whose content is registered stays cached until its slots are needed (least recently
released first). Content ids are never reused, so a key can never match stale content.

    pool = BlockPool(num_blocks=1024, block_size=16)
    shared = pool.match(prompt_ids, limit_tokens=len(prompt_ids) - 1)  # blocks reused
    fresh = [pool.allocate() for _ in range(needed)]
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SCRATCH_BLOCK = 0
"""Never lent: the rows that pad a CUDA-graph batch write their K and V here."""

NO_PARENT = -1
"""Content id before a sequence's first block."""


@dataclass(frozen=True)
class CacheLayout:
    """Shape of the KV cache: what one token costs and how many blocks there are."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def num_slots(self) -> int:
        """Token slots per layer (block 0 included)."""
        return self.num_blocks * self.block_size


def blocks_for_memory(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Most blocks of `block_size` tokens that fit in `budget_bytes`."""
    return max(budget_bytes // (bytes_per_token * block_size), 0)


class PagedKVCache:
    """K and V token slots of all layers: `k[layer]`, `v[layer]` are [slots, kv_heads, head_dim]."""

    def __init__(self, layout: CacheLayout, device: torch.device) -> None:
        if layout.num_blocks < 2:
            raise ValueError(
                f"the KV cache has {layout.num_blocks} blocks; it needs at least 2 "
                "(give the engine more memory: kv_cache_tokens or kv_cache_memory_fraction)"
            )
        self.layout = layout
        shape = (layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        # empty, not zeros: on CPU untouched pages are never resident; every slot read is
        # written first (padded rows only touch the scratch block, whose output is dropped).
        self.k = torch.empty(shape, dtype=layout.dtype, device=device)
        self.v = torch.empty(shape, dtype=layout.dtype, device=device)
        self.k[:, : layout.block_size].zero_()
        self.v[:, : layout.block_size].zero_()


class BlockPool:
    """Lends cache blocks with refcounts and keeps released full blocks findable by content."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))  # block 0: SCRATCH_BLOCK
        self._refcount = [0] * num_blocks
        self._computed = [False] * num_blocks
        self._key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self._content_id = [NO_PARENT] * num_blocks
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._idle_cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, still findable
        self._next_content_id = 0

    @property
    def num_lendable(self) -> int:
        """Blocks that `allocate` can hand out now (free or cached but unused)."""
        return len(self._free) + len(self._idle_cached)

    @property
    def capacity(self) -> int:
        """Blocks one sequence could ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    def allocate(self) -> int:
        """A block for one owner; evicts the least recently released cached block if needed."""
        if self._free:
            block = self._free.popleft()
        elif self._idle_cached:
            block, _ = self._idle_cached.popitem(last=False)
            self._forget(block)
        else:
            raise RuntimeError("KV cache out of blocks: the scheduler admitted too much")
        self._refcount[block] = 1
        self._computed[block] = False
        return block

    def match(self, token_ids: Sequence[int], limit_tokens: int) -> list[tuple[int, int]]:
        """Shared (block, content id) pairs of the longest registered prefix of `token_ids`,
        at most `limit_tokens` tokens long; each block's refcount is taken."""
        found: list[tuple[int, int]] = []
        parent = NO_PARENT
        size = self.block_size
        for start in range(0, limit_tokens - size + 1, size):
            block = self._by_key.get((parent, tuple(token_ids[start : start + size])))
            if block is None:
                break
            self._take(block)
            parent = self._content_id[block]
            found.append((block, parent))
        return found

    def register(self, block: int, parent: int, token_ids: Sequence[int]) -> int:
        """Make `block` (holding `token_ids` after content `parent`) findable; its content id.

        When equal content is registered already, its id is returned and `block` stays
        private (two copies of the same KV, one findable)."""
        key = (parent, tuple(token_ids))
        existing = self._by_key.get(key)
        if existing is not None:
            return self._content_id[existing]
        content_id = self._next_content_id
        self._next_content_id += 1
        self._by_key[key] = block
        self._key[block] = key
        self._content_id[block] = content_id
        return content_id

    def mark_computed(self, block: int) -> None:
        """Every slot of `block` now holds its K and V."""
        self._computed[block] = True

    def is_computed(self, block: int) -> bool:
        """True once the owner that fills `block` has written all of its slots."""
        return self._computed[block]

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks`; unused ones become lendable."""
        for block in blocks:
            self._refcount[block] -= 1
            assert self._refcount[block] >= 0, f"block {block} released twice"
            if self._refcount[block] > 0:
                continue
            if self._key[block] is not None and self._computed[block]:
                self._idle_cached[block] = None
            else:
                self._forget(block)
                self._free.append(block)

    def forget_all(self) -> None:
        """Unregister every block's content (the weights changed, so cached KV is stale)."""
        for block in list(self._idle_cached):
            self._forget(block)
            self._free.append(block)
        self._idle_cached.clear()
        for block in range(self.num_blocks):
            self._forget(block)

    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            self._idle_cached.pop(block, None)
        self._refcount[block] += 1

    def _forget(self, block: int) -> None:
        key = self._key[block]
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]
        self._key[block] = None
        self._content_id[block] = NO_PARENT
