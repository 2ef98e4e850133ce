"""Whether a service's core work is getting done: the truth behind its /healthz.

A service can be up, connected and answering HTTP while the one thing it exists for keeps
failing: a weight-broadcaster that cannot read the staged files dead-letters every version;
a rollout-worker that cannot get weights waits forever while new versions are announced.
Two watches turn that into a reason for /healthz to say so (libs/health_server.py answers
503 for any status but ok/idle):

    failures = FailureWatch("broadcasting staged weights")
    failures.succeeded()                         # after each unit of core work that worked
    failures.failed("version 3: staged file ... does not exist")
    failures.problem()                           # None, or why the work is failing

    lag = LagWatch("weights", limit_s=120.0)
    lag.observe(held=None, available=3, now_s=time.monotonic())
    lag.problem(now_s)                           # None, or "no new weights for 130 s ..."

A FailureWatch reports a problem from the first failure until the next success: the last
attempt failed, so the work is not getting done, and a message like the broadcaster's (one
per trained version) may not come again soon to prove otherwise. A LagWatch reports one when
something newer has been available for longer than `limit_s` without being taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class FailureWatch:
    """The outcome of the latest attempts at a service's core work."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.num_failures = 0  # since the last success
        self.last_error = ""
        self._failing_since_s: float | None = None

    def succeeded(self) -> None:
        self.num_failures = 0
        self.last_error = ""
        self._failing_since_s = None

    def failed(self, error: str) -> None:
        self.num_failures += 1
        self.last_error = error
        if self._failing_since_s is None:
            self._failing_since_s = time.monotonic()

    def problem(self) -> str | None:
        """Why the work is not getting done, or None when its last attempt worked."""
        if self._failing_since_s is None:
            return None
        failing_s = time.monotonic() - self._failing_since_s
        attempts = "attempt" if self.num_failures == 1 else "attempts"
        return (
            f"{self.what} failing for {failing_s:.0f} s ({self.num_failures} {attempts}): "
            f"{self.last_error}"
        )


@dataclass
class LagWatch:
    """How long something newer than what is held has been available and not taken."""

    what: str
    limit_s: float
    held: int | None = field(default=None, init=False)
    available: int | None = field(default=None, init=False)
    _behind_since_s: float | None = field(default=None, init=False)

    def observe(self, held: int | None, available: int | None, now_s: float) -> None:
        """Record what is held and the newest available (None: nothing); a change of what
        is held restarts the clock."""
        behind = available is not None and (held is None or held < available)
        if not behind or held != self.held:
            self._behind_since_s = now_s if behind else None
        elif self._behind_since_s is None:
            self._behind_since_s = now_s
        self.held, self.available = held, available

    def problem(self, now_s: float) -> str | None:
        """Why we are stuck, or None while behind for at most `limit_s` (or not behind)."""
        if self._behind_since_s is None or now_s - self._behind_since_s <= self.limit_s:
            return None
        held = "none" if self.held is None else f"version {self.held}"
        return (
            f"no new {self.what} for {now_s - self._behind_since_s:.0f} s while version "
            f"{self.available} is available (holding {held})"
        )
