"""The `hf` engine's continuation cache: a call that ran out of `max_tokens` keeps its rows'
KV cache, so the next call that continues exactly those rows skips their prefill.

Serve mode decodes a long request in holds of a few steps (libs.serve.holds): each hold is
a call whose prompts are the previous hold's unfinished rows, prompt plus tokens so far.
Without this, every hold would prefill those rows again (16 rows x 2,000 tokens: ~2 s of a
CPU, more than the hold itself). With it, a hold costs its own decode steps:

    cache = ContinuationCache(max_tokens=131_072)
    cache.put(sequences, state)          # rows cut by max_tokens, their KV state
    state = cache.take(prompts)          # the same rows continued: their state

Entries are keyed by the rows' full token sequences in order (any other call misses, and
prefills as usual), taken at most once, and dropped oldest first past `max_tokens` tokens
held. They outlive a weight swap, as a running call's KV does when the `paged` engine swaps
between decode steps: the rest of such a completion is the new version's over the old one's
KV of what came before (its completion says the version it ended on). Dropping them instead
would make every hold after a swap prefill everything again, and a training worker swaps
every second or so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

S = TypeVar("S")
Key = tuple[tuple[int, ...], ...]


class ContinuationCache(Generic[S]):
    """Suspended decoding states by row sequences; LRU within a token budget."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[Key, tuple[S, int]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, sequences: Sequence[Sequence[int]], state: S) -> None:
        """Keep `state` for a later call whose prompts are `sequences`."""
        size = sum(len(sequence) for sequence in sequences)
        if size > self.max_tokens:
            return
        key = _key(sequences)
        self._drop(key)
        self._entries[key] = (state, size)
        self._tokens += size
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def take(self, prompts: Sequence[Sequence[int]]) -> S | None:
        """The state kept for exactly these `prompts` (removed), or None."""
        if not self._entries:
            return None
        entry = self._entries.pop(_key(prompts), None)
        if entry is None:
            return None
        self._tokens -= entry[1]
        return entry[0]

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._tokens -= entry[1]


def _key(sequences: Sequence[Sequence[int]]) -> Key:
    return tuple(tuple(sequence) for sequence in sequences)
