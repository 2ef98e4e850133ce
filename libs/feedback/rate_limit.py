"""Token buckets shared by every replica: one KV key per name, changed by compare-and-swap.

A bucket allows `rate_per_s` tokens a second on average and bursts of `burst`. Its state
(tokens left, when) lives in a KV key (`<prefix>.<name>`), so two API replicas behind one
load balancer give a key its rate once, not twice. The feedback API takes one token per
event (a batch of 50 takes 50: it fits whole or is refused with the seconds until it would
fit, for `Retry-After`); the join takes one per training sample of a key
(libs/feedback/join.py).

A replica does not go to the bus for every event: it leases up to `lease` tokens at a time
(at most a burst, and at most what the rate gives in `lease_s`) and spends them locally; a
lease it has not spent within `lease_s` is dropped (never given back), so all replicas
together stay within the bucket, an idle replica holds nothing, and a dropped lease costs
the key at most `lease_s` of its rate.
Its own takes of one name are serialized (one compare-and-swap in flight per name), so
compare-and-swap conflicts come only from other replicas, and are retried.

A key that expired (its TTL is the time to refill from empty) reads as a full bucket, which
is what it would hold by then.

    bucket = SharedTokenBucket(KvKeys(js, kv, streams.FEEDBACK_RATE), "rate", rate_per_s=1000,
                               burst=2000, lease=50)
    wait_s = await bucket.take("acme-web", 50)      # 0.0: granted; else seconds to wait
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from libs.feedback.kv_state import KvKeys

MAX_CAS_ATTEMPTS = 20


class BucketState(msgspec.Struct, array_like=True):
    """A bucket as stored: tokens left at `at` (Unix s, the writer's clock)."""

    tokens: float
    at: float


def refill(state: BucketState | None, now: float, rate_per_s: float, burst: float) -> float:
    """Tokens a bucket holds at `now`: full when never used (or expired)."""
    if state is None:
        return burst
    return min(burst, state.tokens + max(0.0, now - state.at) * rate_per_s)


@dataclass
class _Lease:
    tokens: float = 0.0
    until: float = 0.0


class SharedStateUnavailable(RuntimeError):
    """The bucket's key kept changing or the bus did not answer: the caller refuses (503)
    or retries later."""


class SharedTokenBucket:
    """Token buckets by name, stored in one KV bucket under `prefix`."""

    def __init__(
        self,
        keys: KvKeys,
        prefix: str,
        *,
        rate_per_s: float,
        burst: int,
        lease: int = 1,
        lease_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or lease < 1 or lease_s <= 0:
            raise ValueError("rate_per_s and lease_s must be > 0, burst and lease >= 1")
        self._keys = keys
        self._prefix = prefix
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.lease = max(1, min(lease, burst, int(rate_per_s * lease_s)))
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # A full bucket refills from empty in this long; an unused key expires after it.
        self._ttl_s = burst / rate_per_s + 1.0

    async def take(self, name: str, count: int = 1) -> float:
        """Take `count` tokens of `name`'s bucket: 0.0 when granted, else the seconds until
        they would be there (`inf` for more than the burst). Raises SharedStateUnavailable."""
        if count > self.burst:
            return float("inf")
        if self._spend_leased(name, count):
            return 0.0
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if self._spend_leased(name, count):  # another take refilled the lease meanwhile
                return 0.0
            return await self._take_shared(name, count)

    def _spend_leased(self, name: str, count: int) -> bool:
        lease = self._leases.get(name)
        if lease is None or lease.until < self._clock() or lease.tokens < count:
            return False
        lease.tokens -= count
        return True

    async def _take_shared(self, name: str, count: int) -> float:
        lease = self._leases.setdefault(name, _Lease())
        if lease.until < self._clock():
            lease.tokens = 0.0  # a lease not spent in time is dropped, not given back
        needed = count - lease.tokens
        key = f"{self._prefix}.{name}"
        for _ in range(MAX_CAS_ATTEMPTS):
            stored = await self._keys.read(key)
            state = msgspec.msgpack.decode(stored.value, type=BucketState) if stored.value else None
            now = self._clock()
            available = refill(state, now, self.rate_per_s, self.burst)
            if available < needed:
                return (needed - available) / self.rate_per_s
            granted = max(needed, min(available, float(self.lease)))
            value = msgspec.msgpack.encode(BucketState(tokens=available - granted, at=now))
            revision = await self._keys.write(key, value, last=stored.revision, ttl_s=self._ttl_s)
            if revision is not None:  # None: another replica changed it; read it again
                lease.tokens += granted - count
                lease.until = now + self.lease_s
                return 0.0
        raise SharedStateUnavailable(f"the shared bucket {key} kept changing; retry")
