"""What one joiner read or wrote lately, so the events of a busy generation cost no bus reads.

- Index entries by generation id (libs/feedback/join_store.py), each with the revision it
  had: an event whose generation is cached is checked against it and, while the cap fills,
  compare-and-swapped on that revision (a stale one fails and is read again). A cached
  entry is trusted only for what cannot change back: that the generation exists, its
  eligibility and product, and that an event id was admitted or the cap is full (the list
  of admitted ids only grows). It is dropped when its join window is over.
- Decoded generations by their stream sequence: a generation's samples fetch it once.
- Generation ids just read as not indexed: for `MISSING_S` an event on one is parked without
  that read first (the read after parking, which the join's protocol needs, still comes),
  so a flood waiting for its generation costs two requests an event, not three.

Both are LRU, bounded in entries; a restart starts empty and reads the bus.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from libs.feedback.join_store import Indexed
from proto.messages import ServedGeneration

K = TypeVar("K")
V = TypeVar("V")

INDEXED_ENTRIES = 4096
MISSING_S = 1.0
# Generations are the largest values (a prompt's and a completion's tokens and logprobs).
GENERATION_ENTRIES = 256


class Lru(Generic[K, V]):
    """At most `size` entries; the least recently used goes first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def drop(self, key: K) -> None:
        self._entries.pop(key, None)


class JoinCache:
    """Index entries and generations this joiner saw lately."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.time) -> None:
        self._window_s = window_s
        self._clock = clock
        self._indexed: Lru[str, Indexed] = Lru(INDEXED_ENTRIES)
        self._generations: Lru[int, ServedGeneration] = Lru(GENERATION_ENTRIES)
        self._missing: Lru[str, float] = Lru(INDEXED_ENTRIES)

    def indexed(self, gid: str) -> Indexed | None:
        """The cached index entry of `gid`, while its window lasts."""
        entry = self._indexed.get(gid)
        if entry is not None and entry.ref.indexed_at + self._window_s <= self._clock():
            self._indexed.drop(gid)
            return None
        return entry

    def keep_indexed(self, gid: str, indexed: Indexed) -> None:
        self._missing.drop(gid)
        if indexed.ref.indexed_at:  # entries of the layout before indexed_at: read each time
            self._indexed.put(gid, indexed)

    def recently_missing(self, gid: str) -> bool:
        """Whether `gid` was read as not indexed within the last MISSING_S."""
        missing_at = self._missing.get(gid)
        return missing_at is not None and self._clock() - missing_at < MISSING_S

    def keep_missing(self, gid: str) -> None:
        self._missing.put(gid, self._clock())

    def generation(self, seq: int) -> ServedGeneration | None:
        return self._generations.get(seq)

    def keep_generation(self, seq: int, generation: ServedGeneration) -> None:
        self._generations.put(seq, generation)
