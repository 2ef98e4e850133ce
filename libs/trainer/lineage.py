"""How far a sample's policy is from the trainer's, across a resume: distance in the version tree.

A trainer that crashed after checkpoint version `c` and resumed announces the checkpoint's
weights as a new number `n` (versions never repeat, libs.trainer.loop). The versions between
are an abandoned branch. Counting staleness as `trainer_version - sample_version` then calls
every sample of version <= c older by `n - c` than it is (its weights are `c`'s), and a
sample of the abandoned branch `c + k` is `k` updates away from `c`'s weights, not
`n - c - k`. The distance in the version tree is what staleness means:

    lineage = Lineage(resumed_from=c, resumed_as=n, segment_start=s)
    lineage.equivalent(v)     # the version on the trainer's own line as far away as v
    staleness = trainer_version - lineage.equivalent(v)

    v >= n:         v                  (made after the resume)
    s <= v <= c:    v + (n - c)        (the line the checkpoint is on, since the last resume)
    c < v < n:      n - (v - c)        (the abandoned branch: v - c updates past c)
    v < s:          v                  (before an earlier resume: counted plainly, as before)

Only the latest resume is remembered (`segment_start` is the one before's `resumed_as`):
samples older than it are older than max_staleness in any run we make.
"""

from __future__ import annotations

import msgspec


class Lineage(msgspec.Struct, kw_only=True, frozen=True):
    """The latest resume: checkpoint version `resumed_from`, announced again as `resumed_as`."""

    resumed_from: int = 0
    resumed_as: int = 0
    segment_start: int = 0

    def equivalent(self, version: int) -> int:
        """The version on the trainer's line as many updates from its weights as `version`."""
        c, n = self.resumed_from, self.resumed_as
        if version >= n or version < self.segment_start:
            return version
        if version <= c:
            return version + (n - c)
        return n - (version - c)

    def resumed(self, checkpoint_version: int, announced_as: int) -> Lineage:
        """The lineage after another resume."""
        return Lineage(
            resumed_from=checkpoint_version,
            resumed_as=announced_as,
            segment_start=self.resumed_as,
        )
