"""The capacity controller's decisions: how many serve replicas product traffic needs, and
which replica to lend or recall. Pure functions of the replicas' heartbeats and a memory.

    memory = Memory()
    plan = decide(statuses, ControllerConfig(replica_capacity_rps=4.0), memory, now_s, utc_s)
    plan.decisions          # [Decision("recall", "replica-2", "load 9.1 req/s ...")]

The load is the fleet's arrival rate: the product requests per second every fresh replica
was asked over its window (a lent replica's last served seconds included, so traffic that
moved is counted once). Serving replicas needed:

    max(min_serving, the schedule's floor, ceil(max(load, forecast) * (1 + headroom) / capacity))

plus one more at once when a serving replica queues more than `max_queued` requests or its
p99 latency passes `max_p99_latency_s`. `forecast` extends the load's trend (a least-squares
line over `trend_window_s`) `recall_lead_s` ahead, and the schedule is read as far ahead, so
replicas are recalled before the load needs them. Recalls are at once, as many as needed
(those on their way to RL first, then the lent ones with the fewest episodes in flight);
a lend is one replica at a time (the least loaded), once the load has needed fewer replicas
(with `lend_margin` more headroom, so a load near a boundary does not lend and recall in
turn) for `lend_after_s`, `cooldown_s` after the last change, with no replica between roles.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from libs.fleet.config import ControllerConfig
from proto.fleet import LENT_ROLES, RETURNING_ROLES, FleetAction, ReplicaStatus

# Roles a replica holds between two commands' effects: no new lend while one is there.
MOVING_ROLES = ("draining", "lending", "recalling", "restoring")


@dataclass(frozen=True)
class Decision:
    action: FleetAction
    replica_id: str
    reason: str


@dataclass
class Plan:
    """What the controller saw and what it decided."""

    load_rps: float
    forecast_rps: float
    num_serving: int
    num_needed: int
    num_lent: int
    decisions: list[Decision] = field(default_factory=list)


class LoadTrend:
    """The fleet's load over the last `window_s` seconds, extended by a least-squares line."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, now_s: float, load_rps: float) -> None:
        self._samples.append((now_s, load_rps))
        while self._samples and self._samples[0][0] < now_s - self.window_s:
            self._samples.popleft()

    def forecast(self, ahead_s: float) -> float:
        """The load `ahead_s` after the last sample, on the trend line (never below 0)."""
        if len(self._samples) < 2:
            return self._samples[-1][1] if self._samples else 0.0
        times = [t for t, _ in self._samples]
        loads = [load for _, load in self._samples]
        mean_t, mean_l = sum(times) / len(times), sum(loads) / len(loads)
        spread = sum((t - mean_t) ** 2 for t in times)
        if spread == 0:
            return loads[-1]
        slope = sum((t - mean_t) * (lo - mean_l) for t, lo in zip(times, loads, strict=True))
        slope /= spread
        return max(0.0, mean_l + slope * (times[-1] + ahead_s - mean_t))


@dataclass
class Memory:
    """What the controller carries from one tick to the next."""

    trend: LoadTrend | None = None
    low_since_s: float | None = None  # since when fewer replicas would do
    last_change_s: float = -math.inf  # the last lend or recall sent


def decide(
    statuses: list[ReplicaStatus],
    config: ControllerConfig,
    memory: Memory,
    now_s: float,
    utc_s: float,
) -> Plan:
    """The plan for this tick (`statuses`: fresh heartbeats only; `now_s` monotonic)."""
    if memory.trend is None:
        memory.trend = LoadTrend(config.trend_window_s)
    load = sum(s.load.requests_per_s for s in statuses)
    memory.trend.observe(now_s, load)
    forecast = memory.trend.forecast(config.recall_lead_s)
    serving = [s for s in statuses if s.role == "serving" and s.ready]
    returning = [s for s in statuses if s.role in RETURNING_ROLES]
    lent = [s for s in statuses if s.role in LENT_ROLES]
    needed, why = _needed(statuses, serving, load, forecast, config, utc_s)
    have = len(serving) + len(returning)
    plan = Plan(round(load, 4), round(forecast, 4), have, needed, len(lent))
    if needed > have:
        memory.low_since_s = None
        plan.decisions = [
            Decision("recall", s.replica_id, f"{why}; {have} serving: recalled")
            for s in _recall_order(lent)[: needed - have]
        ]
    elif needed < have and _by_load(load, forecast, config, config.lend_headroom) < have:
        memory.low_since_s = memory.low_since_s if memory.low_since_s is not None else now_s
        if _may_lend(statuses, lent, config, memory, now_s) and serving:
            target = min(serving, key=_least_loaded)
            reason = f"{why}; {have} serving for {now_s - memory.low_since_s:.0f} s: lent"
            plan.decisions = [Decision("lend", target.replica_id, reason)]
    else:
        memory.low_since_s = None
    if plan.decisions:
        memory.last_change_s = now_s
    return plan


def _needed(
    statuses: list[ReplicaStatus],
    serving: list[ReplicaStatus],
    load: float,
    forecast: float,
    config: ControllerConfig,
    utc_s: float,
) -> tuple[int, str]:
    """Serving replicas wanted now, and why (the largest of the reasons)."""
    by_load = _by_load(load, forecast, config, config.headroom)
    reasons = {
        f"min_serving {config.min_serving}": config.min_serving,
        f"the schedule's floor within {config.recall_lead_s:.0f} s": config.scheduled_min(utc_s),
        f"load {load:.2f} req/s (forecast {forecast:.2f} in {config.recall_lead_s:.0f} s) "
        f"needs {by_load} at {config.replica_capacity_rps:g} req/s each with "
        f"{config.headroom:.0%} headroom": by_load,
    }
    pressed = [s.replica_id for s in serving if _under_pressure(s, config)]
    if pressed:
        reasons[f"{', '.join(pressed)} queue or slow past the thresholds"] = len(serving) + 1
    why, needed = max(reasons.items(), key=lambda item: item[1])
    return min(needed, len(statuses)), why


def _by_load(load: float, forecast: float, config: ControllerConfig, headroom: float) -> int:
    """Replicas that serve the larger of the load and its forecast with `headroom` spare."""
    expected = max(load, forecast) * (1 + headroom)
    return math.ceil(round(expected / config.replica_capacity_rps, 6))


def _under_pressure(status: ReplicaStatus, config: ControllerConfig) -> bool:
    slow = config.max_p99_latency_s is not None and (
        (status.load.p99_latency_s or 0.0) > config.max_p99_latency_s
    )
    return status.load.queued > config.max_queued or slow


def _may_lend(
    statuses: list[ReplicaStatus],
    lent: list[ReplicaStatus],
    config: ControllerConfig,
    memory: Memory,
    now_s: float,
) -> bool:
    assert memory.low_since_s is not None
    if now_s - memory.low_since_s < config.lend_after_s:
        return False
    if now_s - memory.last_change_s < config.cooldown_s:
        return False
    if config.max_lent is not None and len(lent) >= config.max_lent:
        return False
    return not any(s.role in MOVING_ROLES for s in statuses)


def _least_loaded(status: ReplicaStatus) -> tuple[float, int, str]:
    return status.load.requests_per_s, status.load.running, status.replica_id


def _recall_order(lent: list[ReplicaStatus]) -> list[ReplicaStatus]:
    """Cheapest to bring back first: not lent yet, then the fewest episodes in flight."""
    order = {role: index for index, role in enumerate(LENT_ROLES)}
    return sorted(lent, key=lambda s: (order[s.role], s.episodes_in_flight, s.replica_id))
