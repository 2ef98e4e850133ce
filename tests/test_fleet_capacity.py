"""The capacity controller's decisions (libs/fleet/capacity.py) and their configuration:
how many replicas serve, which one is lent or recalled, and why, from heartbeats.

Run: .venv/bin/python -m pytest tests/test_fleet_capacity.py -q
"""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from libs.fleet.capacity import LoadTrend, Memory, Plan, decide
from libs.fleet.config import ControllerConfig, ScheduleWindow
from libs.fleet.load_meter import LoadMeter
from proto.fleet import ReplicaLoad, ReplicaRole, ReplicaStatus
from services.capacity_controller.settings import CapacityControllerSettings

CONFIG = ControllerConfig(
    replica_capacity_rps=2.0, headroom=0.5, lend_margin=0.25, lend_after_s=10.0,
    cooldown_s=5.0, recall_lead_s=30.0, trend_window_s=60.0,
)  # fmt: skip
NOON_UTC = 12 * 3600.0


def replica(
    name: str, role: ReplicaRole = "serving", rps: float = 0.0, **load: float
) -> ReplicaStatus:
    return ReplicaStatus(
        replica_id=name,
        role=role,
        ready=role == "serving",
        load=ReplicaLoad(window_s=20.0, requests_per_s=rps, **load),  # type: ignore[arg-type]
        episodes_in_flight=int(load.get("queued", 0)) if role == "lent" else 0,
    )


def at(
    statuses: list[ReplicaStatus],
    now_s: float,
    memory: Memory,
    config: ControllerConfig = CONFIG,
    utc_s: float = NOON_UTC,
) -> Plan:
    return decide(statuses, config, memory, now_s, utc_s)


def actions(plan: Plan) -> list[tuple[str, str]]:
    return [(d.action, d.replica_id) for d in plan.decisions]


def test_low_load_lends_the_least_loaded_replica_once_it_stayed_low() -> None:
    memory = Memory()
    fleet = [replica("a", rps=0.2), replica("b", rps=0.1), replica("c", rps=0.3)]
    assert actions(at(fleet, 0.0, memory)) == []  # low since now
    assert actions(at(fleet, 9.0, memory)) == []  # not for lend_after_s yet
    plan = at(fleet, 10.0, memory)
    assert actions(plan) == [("lend", "b")]
    assert (plan.num_serving, plan.num_needed) == (3, 1)
    assert "min_serving 1" in plan.decisions[0].reason and "lent" in plan.decisions[0].reason


def test_one_lend_at_a_time_and_a_cooldown_between() -> None:
    memory = Memory()
    fleet = [replica("a"), replica("b"), replica("c")]
    at(fleet, 0.0, memory)
    assert actions(at(fleet, 10.0, memory)) == [("lend", "a")]
    moving = [replica("a", "draining"), replica("b"), replica("c")]
    assert actions(at(moving, 20.0, memory)) == []  # a replica between roles
    lent = [replica("a", "lent"), replica("b"), replica("c")]
    assert actions(at(lent, 12.0, memory)) == []  # within cooldown_s of the last lend
    assert actions(at(lent, 15.0, memory)) == [("lend", "b")]
    assert actions(at([replica("a", "lent"), replica("b", "lent"), replica("c")], 30.0,
                      memory)) == []  # fmt: skip


def test_max_lent_caps_the_loans() -> None:
    config = CONFIG.model_copy(update={"max_lent": 1})
    memory = Memory()
    fleet = [replica("a", "lent"), replica("b"), replica("c")]
    at(fleet, 0.0, memory, config)
    assert actions(at(fleet, 100.0, memory, config)) == []


def test_a_load_near_a_boundary_does_not_lend_what_it_would_recall() -> None:
    """2.5 req/s needs 2 replicas at 50% headroom (1.9), but 3 with the margin's 75% (2.2):
    none is lent, so the next tick's noise cannot recall it."""
    memory = Memory()
    fleet = [replica("a", rps=0.9), replica("b", rps=0.8), replica("c", rps=0.8)]
    for now_s in (0.0, 20.0, 40.0):
        plan = at(fleet, now_s, memory)
        assert plan.num_needed == 2 and actions(plan) == []
    lighter = [replica("a", rps=0.7), replica("b", rps=0.6), replica("c", rps=0.7)]
    at(lighter, 50.0, memory)  # 2.0 req/s: 2 serve it with the margin too (1.75)
    assert actions(at(lighter, 60.0, memory)) == [("lend", "b")]


def test_rising_load_recalls_ahead_of_need_from_its_trend() -> None:
    memory = Memory()
    lent = [replica("b", "lent"), replica("c", "lent")]
    # 1.0 req/s needs one replica now; rising 0.05 req/s a second, it needs two within 30 s.
    for now_s in range(0, 21, 5):
        plan = at([replica("a", rps=1.0 + 0.05 * now_s), *lent], float(now_s), memory)
    assert plan.load_rps == pytest.approx(2.0) and plan.forecast_rps == pytest.approx(3.5)
    assert actions(plan) == [("recall", "b"), ("recall", "c")]
    assert "forecast 3.50 in 30 s" in plan.decisions[0].reason


def test_a_queue_or_a_slow_p99_recalls_one_at_once() -> None:
    config = CONFIG.model_copy(update={"max_p99_latency_s": 2.0})
    lent = [replica("b", "lent"), replica("c", "lent")]
    queued = at([replica("a", rps=0.1, queued=3), *lent], 0.0, Memory(), config)
    assert actions(queued) == [("recall", "b")] and "queue or slow" in queued.decisions[0].reason
    slow = at([replica("a", rps=0.1, p99_latency_s=3.0), *lent], 0.0, Memory(), config)
    assert actions(slow) == [("recall", "b")]


def test_recalls_take_the_cheapest_first_and_count_returning_replicas() -> None:
    fleet = [
        replica("a", rps=9.0),
        replica("b", "lent", queued=5),  # five episodes in flight
        replica("c", "lent", queued=1),
        replica("d", "draining"),
        replica("e", "restoring"),
    ]
    plan = at(fleet, 0.0, Memory())
    # 9 req/s needs 5 (6.75 at 50% headroom, at most the fleet's 5); a and e count as serving.
    assert (plan.num_needed, plan.num_serving) == (5, 2)
    assert actions(plan) == [("recall", "d"), ("recall", "c"), ("recall", "b")]


def test_a_schedule_window_recalls_its_lead_time_before_it_starts() -> None:
    config = CONFIG.model_copy(
        update={"schedule": [ScheduleWindow(start="12:01", end="13:00", min_serving=3)]}
    )
    fleet = [replica("a"), replica("b", "lent"), replica("c", "lent")]
    assert actions(at(fleet, 0.0, Memory(), config, utc_s=NOON_UTC)) == []  # 60 s ahead
    plan = at(fleet, 0.0, Memory(), config, utc_s=NOON_UTC + 31)  # 29 s ahead: within lead
    assert actions(plan) == [("recall", "b"), ("recall", "c")]
    assert "schedule" in plan.decisions[0].reason
    night = ScheduleWindow(start="22:00", end="06:00", min_serving=2)  # across midnight
    late = CONFIG.model_copy(update={"schedule": [night], "recall_lead_s": 0.0})
    assert late.scheduled_min(23 * 3600) == 2 and late.scheduled_min(5 * 3600) == 2
    assert late.scheduled_min(NOON_UTC) == 0


def test_the_trend_is_a_least_squares_line() -> None:
    trend = LoadTrend(window_s=10.0)
    assert trend.forecast(5.0) == 0.0
    for t in range(0, 11):
        trend.observe(float(t), 2.0 * t)
    assert trend.forecast(5.0) == pytest.approx(30.0)
    trend.observe(30.0, 0.0)  # the samples older than the window are dropped
    assert trend.forecast(100.0) == 0.0


def test_bad_settings_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match="HH:MM"):
        ScheduleWindow(start="8:00", end="20:00", min_serving=1)
    with pytest.raises(ValidationError, match="empty"):
        ControllerConfig(schedule=[ScheduleWindow(start="08:00", end="08:00", min_serving=1)])
    with pytest.raises(ValidationError, match="replica_capacity_rps"):
        ControllerConfig(replica_capacity_rps=0)
    with pytest.raises(ValidationError, match="stale_s"):
        CapacityControllerSettings(tick_s=5.0, stale_s=5.0)


def test_the_load_meter_counts_arrivals_and_answered_latency() -> None:
    meter = LoadMeter(window_s=10.0)
    arrived = [meter.arrived() for _ in range(20)]
    for started in arrived[:18]:
        meter.answered(started, 200)
    meter.answered(arrived[18], 503)
    load = meter.load(running=1, queued=2)
    assert load.requests_per_s == pytest.approx(2.0) and (load.running, load.queued) == (1, 2)
    assert load.errors == 1 and load.p99_latency_s is not None
    assert 0 <= load.p99_latency_s < time.monotonic() - arrived[0] + 1e-6
