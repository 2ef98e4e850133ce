"""How far a stream was consumed, exactly: a floor plus the runs of sequences done above it.

Samples are trained in groups, not in stream order, so "the last sequence read" is not
enough: some earlier sequences may still wait in an incomplete group. The cursor keeps the
highest sequence below which everything is done (trained, dropped or dead-lettered), plus
the done sequences above it as inclusive runs `[first, last]`. After a restart, reading
resumes at `floor + 1` and skips what is done: nothing is lost and nothing is trained twice.

Runs, not single sequences: the cursor's size is the number of gaps above the floor, not the
number of sequences done, so one sequence held back (a group still open) costs one run
whatever follows it. `is_done` is a binary search; `mark_done` a merge.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

import msgspec


class ConsumedCursor(msgspec.Struct, kw_only=True):
    """Everything at or below `floor` is done, and so is each sequence in `done_runs`."""

    floor: int = 0
    done_runs: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # Checkpoints written before runs listed single sequences; read, then folded into runs.
    done: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.done:
            legacy, self.done = self.done, []
            self.mark_done(legacy)

    @property
    def num_runs(self) -> int:
        return len(self.done_runs)

    def is_done(self, sequence: int) -> bool:
        if sequence <= self.floor:
            return True
        index = bisect_right(self.done_runs, sequence, key=lambda run: run[0]) - 1
        return index >= 0 and sequence <= self.done_runs[index][1]

    def mark_done(self, sequences: Iterable[int]) -> None:
        """Record sequences as done and raise the floor over any contiguous run."""
        new = _runs(sorted({s for s in sequences if s > self.floor}))
        merged: list[tuple[int, int]] = []
        for first, last in sorted(self.done_runs + new):
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        if merged and merged[0][0] <= self.floor + 1:
            self.floor = max(self.floor, merged.pop(0)[1])
        self.done_runs = merged


def _runs(sequences: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct sequences -> inclusive runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for seq in sequences:
        if runs and seq == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return runs
