"""How far a stream was consumed, exactly: a floor plus the sequences done above it.

Samples are trained in groups, not in stream order, so "the last sequence read" is not
enough: some earlier sequences may still wait in an incomplete group. The cursor keeps the
highest sequence below which everything is done (trained or dropped), plus the done
sequences above it. After a restart, reading resumes at `floor + 1` and skips `done`:
nothing is lost and nothing is trained twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class ConsumedCursor(msgspec.Struct, kw_only=True):
    """Everything at or below `floor` is done, and so is each sequence in `done`."""

    floor: int = 0
    done: list[int] = msgspec.field(default_factory=list)

    def is_done(self, sequence: int) -> bool:
        return sequence <= self.floor or sequence in self._done_set()

    def mark_done(self, sequences: Iterable[int]) -> None:
        """Record sequences as done and raise the floor over any contiguous run."""
        done = self._done_set() | {s for s in sequences if s > self.floor}
        while self.floor + 1 in done:
            self.floor += 1
            done.discard(self.floor)
        self.done = sorted(done)

    def _done_set(self) -> set[int]:
        return set(self.done)
