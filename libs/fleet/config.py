"""How serve replicas are lent to RL (`LendingConfig`) and when (`ControllerConfig`).

`LendingConfig` is the rollout-worker's `lending` (RLPIPE_ROLLOUT_WORKER_LENDING_<FIELD>):
a serve replica that may be lent, and the bounds of each step of a loan and of a recall.
`ControllerConfig` is the capacity controller's `fleet` (RLPIPE_CAPACITY_CONTROLLER_FLEET_
<FIELD>): how much traffic one replica takes, the headroom kept, when to lend and when to
recall ahead of load (a trend and a daily schedule). Both refuse values that cannot work.
"""

from __future__ import annotations

import re
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_CLOCK = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


class LendingConfig(BaseModel):
    """Whether a serve replica may be lent to RL, and the bounds of a loan (the
    rollout-worker's `lending`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="Take lend/recall commands and publish a heartbeat to the fleet bucket "
        "(needs serve mode, promoted versions only, and weights written in place)",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between two status heartbeats")
    load_window_s: float = Field(
        20.0, gt=0, description="Window of the request rate and latency a heartbeat reports"
    )
    unready_grace_s: float = Field(
        2.0,
        ge=0,
        description="Seconds a lent replica keeps answering after readiness turns off, until "
        "the load balancer has taken it out",
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for open product requests to finish; past it the loan is "
        "given up and the replica serves on",
    )
    weights_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the trainer's newest version; past it the loan is given up",
    )
    recall_grace_s: float = Field(
        10.0,
        ge=0,
        description="Seconds episodes in flight get to finish at a recall; the rest go back "
        "to the task queue",
    )


class ScheduleWindow(BaseModel):
    """A daily window (UTC) in which at least `min_serving` replicas serve: a known peak."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field(description="Start, HH:MM UTC")
    end: str = Field(description="End, HH:MM UTC (before start: the window passes midnight)")
    min_serving: int = Field(ge=0, description="Replicas serving product users in the window")

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, value: str) -> str:
        if not _CLOCK.match(value):
            raise ValueError(f"{value!r} is not a time of day: write HH:MM (24 h, UTC)")
        return value

    def seconds(self) -> tuple[int, int]:
        """Start and end as seconds since midnight."""
        return _seconds(self.start), _seconds(self.end)


class ControllerConfig(BaseModel):
    """When the capacity controller lends and recalls (the controller's `fleet`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The default is what one CPU replica of the demo's tiny policy takes (docs/benchmarks.md);
    # measure yours (bench/day_of_traffic_bench.py).
    replica_capacity_rps: float = Field(
        2.0,
        gt=0,
        description="Product requests per second one replica serves within its latency target",
    )
    headroom: float = Field(
        0.5, ge=0, description="Spare capacity kept serving, as a fraction of the load"
    )
    # A load near a boundary would otherwise lend a replica and recall it at the next tick.
    lend_margin: float = Field(
        0.25,
        ge=0,
        description="Headroom a lend must leave on top of `headroom`, as a fraction of the load",
    )
    min_serving: int = Field(1, ge=1, description="Replicas that always serve product users")
    max_lent: int | None = Field(
        None, ge=0, description="Most replicas lent at once (unset: as many as the load allows)"
    )
    lend_after_s: float = Field(
        60.0, ge=0, description="Seconds the load must stay low before a replica is lent"
    )
    cooldown_s: float = Field(
        30.0, ge=0, description="Seconds after a lend or recall before the next lend"
    )
    recall_lead_s: float = Field(
        120.0,
        ge=0,
        description="How far ahead the load trend (and the schedule) is read: replicas are "
        "recalled this long before the load needs them",
    )
    trend_window_s: float = Field(
        60.0, gt=0, description="Seconds of load history the trend is fitted on"
    )
    max_queued: int = Field(
        0, ge=0, description="A serving replica with more queued requests recalls one at once"
    )
    max_p99_latency_s: float | None = Field(
        None, gt=0, description="A serving replica slower than this (p99) recalls one at once"
    )
    schedule: list[ScheduleWindow] = Field(
        default_factory=list,
        description='Daily windows of known peaks, JSON [{"start": "08:00", "end": "20:00", '
        '"min_serving": 3}]',
    )

    @model_validator(mode="after")
    def _windows_not_empty(self) -> Self:
        for window in self.schedule:
            if window.start == window.end:
                raise ValueError(f"schedule window {window.start}-{window.end} is empty")
        return self

    @property
    def lend_headroom(self) -> float:
        """The headroom a lend must leave: `headroom` plus `lend_margin`."""
        return self.headroom + self.lend_margin

    def scheduled_min(self, utc_seconds: float) -> int:
        """The schedule's `min_serving` at this time of day, read `recall_lead_s` ahead."""
        at = (utc_seconds + self.recall_lead_s) % 86_400
        floors = [w.min_serving for w in self.schedule if _inside(at, *w.seconds())]
        return max(floors, default=0)


def _seconds(clock: str) -> int:
    hours, minutes = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60


def _inside(at: float, start: int, end: int) -> bool:
    """Whether `at` (seconds of the day) lies in [start, end), which may pass midnight."""
    return start <= at < end if start < end else at >= start or at < end
