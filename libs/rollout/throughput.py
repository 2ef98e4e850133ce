"""Busy fraction and tokens/s of the rollout-worker's engine over a sliding window of wall time.

    meter = ThroughputMeter(window_s=60.0)
    meter.record(start, end, num_tokens)       # one generate call, when it ends
    meter.busy_fraction(), meter.tokens_per_s()

The batcher (libs.rollout.batcher) records every engine call; the worker's health and
Prometheus gauges read it.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import Counter, Gauge

GENERATED_TOKENS = Counter("rlpipe_rollout_generated_tokens_total", "Tokens sampled by the engine")
GENERATE_SECONDS = Counter(
    "rlpipe_rollout_generate_seconds_total", "Time spent inside engine.generate"
)
BUSY_FRACTION = Gauge(
    "rlpipe_rollout_busy_ratio", "Fraction of recent wall time spent inside engine.generate"
)
TOKENS_PER_SECOND = Gauge(
    "rlpipe_rollout_generated_tokens_per_second", "Tokens sampled per wall-clock second, recently"
)


class ThroughputMeter:
    """Busy fraction and tokens/s over the last `window_s` seconds of wall time.

    Each call costs O(1) amortized: a continuous-batching engine records one call per request
    (hundreds a second), and a meter that sorted the window's calls at every record keeps
    the rollout-worker's event loop busy with itself, weight announcements waiting unread."""

    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.started = time.monotonic()
        self._calls: deque[tuple[float, int]] = deque()  # (end, tokens), in recording order
        self._tokens = 0  # sampled by the calls in `_calls`
        # The union of the calls' intervals: disjoint (start, end), sorted, and their total.
        self._busy: deque[tuple[float, float]] = deque()
        self._busy_s = 0.0

    def record(self, start: float, end: float, num_tokens: int) -> None:
        """One generate call from `start` to `end` (monotonic seconds) that sampled tokens."""
        self._calls.append((end, num_tokens))
        self._tokens += num_tokens
        self._add_busy(start, end)
        GENERATED_TOKENS.inc(num_tokens)
        GENERATE_SECONDS.inc(end - start)
        BUSY_FRACTION.set(self.busy_fraction(end))
        TOKENS_PER_SECOND.set(self.tokens_per_s(end))

    def _add_busy(self, start: float, end: float) -> None:
        """Merge [start, end] into the union (calls mostly end in order: the tail)."""
        later = []
        while self._busy and self._busy[-1][0] > end:  # wholly after it: a call recorded late
            later.append(self._busy.pop())
        while self._busy and self._busy[-1][1] >= start:  # overlapping: one interval
            merged_start, merged_end = self._busy.pop()
            self._busy_s -= merged_end - merged_start
            start, end = min(start, merged_start), max(end, merged_end)
        self._busy.append((start, end))
        self._busy_s += end - start
        self._busy.extend(reversed(later))

    def _window(self, now: float | None) -> tuple[float, float]:
        """(window start, window length) ending at `now`; drops calls that ended before it."""
        now = time.monotonic() if now is None else now
        begin = max(self.started, now - self.window_s)
        while self._calls and self._calls[0][0] < begin:
            self._tokens -= self._calls.popleft()[1]
        while self._busy and self._busy[0][1] < begin:
            dropped_start, dropped_end = self._busy.popleft()
            self._busy_s -= dropped_end - dropped_start
        return begin, max(now - begin, 1e-9)

    def busy_fraction(self, now: float | None = None) -> float:
        """Time inside generate over wall time, in [0, 1]. Overlapping calls (a continuous
        batching engine runs many at once) count once: the union of their intervals."""
        begin, length = self._window(now)
        busy = self._busy_s
        if self._busy:  # only the oldest interval can start before the window
            first_start, first_end = self._busy[0]
            busy -= max(0.0, min(first_end, begin) - first_start)
        return min(max(busy, 0.0) / length, 1.0)

    def tokens_per_s(self, now: float | None = None) -> float:
        """Sampled tokens per wall-clock second."""
        _, length = self._window(now)
        return self._tokens / length
