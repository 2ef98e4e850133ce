"""A token bucket per API key: `rate_per_s` events a second on average, bursts of `burst`.

Each event of a request takes one token (a batch of 50 takes 50). A request that does not
fit is refused whole, with the seconds until it would fit (for `Retry-After`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated_at: float


class RateLimiter:
    """Token buckets keyed by API key name; all state in memory (one per process)."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def try_take(self, key: str, num_events: int = 1) -> float:
        """Take `num_events` tokens: 0.0 when granted, else the seconds to wait before retrying.

        A request of more events than the burst can never fit; it gets `inf`.
        """
        if num_events > self.burst:
            return float("inf")
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        else:
            elapsed = now - bucket.updated_at
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
            bucket.updated_at = now
        if bucket.tokens >= num_events:
            bucket.tokens -= num_events
            return 0.0
        return (num_events - bucket.tokens) / self.rate_per_s
