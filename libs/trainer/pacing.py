"""The staleness pacer: the trainer's staleness bound moved by the mismatch it measures.

    pacer = StalenessPacer(config.pacing, start=config.max_staleness)   # the bound starts there
    ...one step, its per-staleness mismatch (libs.rl.mismatch.mismatch_by_staleness)...
    decision = pacer.observe(step, stats.mismatch_by_staleness, num_kept, num_dropped)
    pacer.bound          # the bound the next step (and the feeder, through the KV) uses

A constant bound is wrong both ways: too high, samples many versions old carry a policy the
trainer has left behind (their importance weights spread, the truncated or masked tokens
grow, learning per sample falls); too low, the work of versions just past it is thrown away.
The pacer reads what the bound costs from the step itself: the behavior-vs-trainer mismatch
of the stalest tokens it kept (k3 KL(behavior || trainer) and the fraction of importance
weights outside [1/cap, cap]), smoothed per staleness level over steps. Within
[min_staleness, max_staleness] (unset max: the trainer's max_staleness, the most the user
allows, where the bound starts):
- lower: the stalest level's smoothed mismatch is over a target -> the bound goes one below
  that level (so those tokens are no longer trained);
- raise: the stalest level's mismatch is under `raise_below` x the targets (a margin: the
  next level is more off-policy than this one) while samples are dropped as stale -> +1,
  unless that next level was measured over target lately (the bound came down from it);
- else hold. After a change the bound holds `hold_steps` steps (hysteresis: the samples in
  flight were made under the old bound), and the gap between the two thresholds keeps it
  from flapping. Every call returns its decision for the step record.

A plain object that owns its state; no bus, no torch: tested on synthetic signals. The bound
is not checkpointed: a resumed trainer starts from the configured one and re-learns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator


class PacingConfig(BaseModel):
    """Limits and targets of the adaptive staleness bound (`trainer.pacing.*`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Off until measured on a GPU: on the 2-core arith demo at forced staleness it halved the
    # staleness trained on (5.8 -> 3.3 versions) and reached reward 0.8 in 170-177 steps
    # (unpaced: 179-234), a gain within the spread of two identical runs (158 and 178 steps);
    # at the demo's own settings (staleness under 1) it never moved the bound.
    enabled: bool = Field(
        False,
        description="Move the staleness bound with the measured mismatch (off: max_staleness "
        "stays as configured; never with max_staleness 0, the synchronous baseline)",
    )
    min_staleness: int = Field(1, ge=0, description="Lowest bound the pacer sets")
    max_staleness: int | None = Field(
        None, ge=0, description="Highest bound the pacer sets; unset: trainer.max_staleness"
    )
    # On the 2-core demo at forced staleness 5-8, the stalest tokens' KL ran 0.01-0.04 while
    # the policy moved fast and under 0.001 once it had learned: 0.01 lowers the bound in
    # the first phase and gives it back in the second.
    target_kl: float = Field(
        0.01,
        gt=0,
        description="k3 KL(behavior || trainer), nats per token, of the stalest trained tokens "
        "above which the bound is lowered",
    )
    target_outside_fraction: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Fraction of the stalest trained tokens whose importance weight leaves "
        "[1/cap, cap] above which the bound is lowered",
    )
    raise_below: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Raise the bound only while both signals are under this fraction of "
        "their targets",
    )
    raise_dropped_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Raise the bound only while at least this fraction of samples is dropped "
        "as stale (smoothed)",
    )
    smoothing_steps: int = Field(
        8, ge=1, description="Horizon of the moving average of each signal, in steps"
    )
    hold_steps: int = Field(8, ge=0, description="Steps the bound holds after a change")
    min_tokens: int = Field(
        32, ge=1, description="Trained tokens a staleness level needs in a step to be measured"
    )

    @model_validator(mode="after")
    def _limits_ordered(self) -> PacingConfig:
        if self.max_staleness is not None and self.min_staleness > self.max_staleness:
            raise ValueError(
                f"pacing.min_staleness ({self.min_staleness}) must be <= pacing.max_staleness "
                f"({self.max_staleness})"
            )
        return self


class LevelMismatch(Protocol):
    """What the pacer reads of one staleness level (libs.rl.mismatch.MismatchStats)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def kl(self) -> float: ...
    @property
    def is_outside_fraction(self) -> float: ...


class PacingDecision(msgspec.Struct, kw_only=True):
    """One step's pacing decision, as the step record carries it."""

    bound_before: int
    bound_after: int
    action: str
    """lower, raise, hold, wait (held after a change) or no_signal."""
    reason: str
    signal_staleness: int | None = None
    """The stalest measured level at or under the bound: the signal's source."""
    signal_kl: float | None = None
    signal_outside_fraction: float | None = None
    dropped_fraction: float = 0.0
    """Smoothed fraction of samples dropped as stale."""


@dataclass
class _Smoothed:
    kl: float
    outside: float
    step: int  # last step measured


class StalenessPacer:
    """The staleness bound and the smoothed signals it is decided from."""

    def __init__(self, config: PacingConfig, start: int) -> None:
        self.config = config
        self.upper = start if config.max_staleness is None else config.max_staleness
        self.lower = min(config.min_staleness, self.upper)
        self.bound = min(max(start, self.lower), self.upper)
        self._levels: dict[int, _Smoothed] = {}
        self._dropped = 0.0
        self._alpha = 2.0 / (config.smoothing_steps + 1)
        self._last_change_step: int | None = None

    def observe(
        self,
        step: int,
        levels: Mapping[int, LevelMismatch],
        num_kept: int,
        num_dropped: int,
    ) -> PacingDecision:
        """Take one step's measurements; returns the decision (self.bound is the new bound)."""
        self._smooth(step, levels, num_kept, num_dropped)
        before = self.bound
        signal = self._signal(step)
        action, reason = self._decide(step, signal)
        if self.bound != before:
            self._last_change_step = step
        return PacingDecision(
            bound_before=before,
            bound_after=self.bound,
            action=action,
            reason=reason,
            signal_staleness=signal[0] if signal else None,
            signal_kl=signal[1].kl if signal else None,
            signal_outside_fraction=signal[1].outside if signal else None,
            dropped_fraction=self._dropped,
        )

    def _smooth(
        self, step: int, levels: Mapping[int, LevelMismatch], num_kept: int, num_dropped: int
    ) -> None:
        """Exponential moving averages per level (first measure taken as is) and of drops."""
        for level, stats in levels.items():
            if stats.num_tokens < self.config.min_tokens:
                continue  # too few tokens: one odd sample would move the bound
            old = self._levels.get(level)
            if old is None:
                self._levels[level] = _Smoothed(stats.kl, stats.is_outside_fraction, step)
                continue
            old.kl += self._alpha * (stats.kl - old.kl)
            old.outside += self._alpha * (stats.is_outside_fraction - old.outside)
            old.step = step
        total = num_kept + num_dropped
        if total:
            self._dropped += self._alpha * (num_dropped / total - self._dropped)

    def _fresh(self, step: int, level: int) -> _Smoothed | None:
        """A level's figures when measured lately (a level unmeasured for several horizons
        describes an older policy, not this one)."""
        smoothed = self._levels.get(level)
        recent = step - 3 * self.config.smoothing_steps
        return smoothed if smoothed is not None and smoothed.step >= recent else None

    def _signal(self, step: int) -> tuple[int, _Smoothed] | None:
        """The stalest level within the bound measured lately."""
        fresh = [lvl for lvl in self._levels if lvl <= self.bound and self._fresh(step, lvl)]
        if not fresh:
            return None
        level = max(fresh)
        return level, self._levels[level]

    def _over(self, smoothed: _Smoothed) -> bool:
        config = self.config
        return smoothed.kl > config.target_kl or smoothed.outside > config.target_outside_fraction

    def _decide(self, step: int, signal: tuple[int, _Smoothed] | None) -> tuple[str, str]:
        """(action, reason); moves self.bound on lower and raise."""
        config = self.config
        if signal is None:
            return "no_signal", f"no staleness level with {config.min_tokens}+ tokens measured"
        level, smoothed = signal
        figures = f"kl {smoothed.kl:.4g}, outside {smoothed.outside:.3g} at staleness {level}"
        if self._last_change_step is not None and step - self._last_change_step < config.hold_steps:
            return "wait", f"held {config.hold_steps} steps after a change; {figures}"
        if self._over(smoothed) and self.bound > self.lower:
            self.bound = max(self.lower, min(self.bound, level) - 1)
            return "lower", (
                f"{figures} over target (kl {config.target_kl:g}, "
                f"outside {config.target_outside_fraction:g})"
            )
        under = (
            smoothed.kl < config.raise_below * config.target_kl
            and smoothed.outside < config.raise_below * config.target_outside_fraction
        )
        dropping = self._dropped >= config.raise_dropped_fraction and self._dropped > 0
        above = self._fresh(step, self.bound + 1)
        if above is not None and self._over(above):  # lowered from there lately: stay
            return "hold", f"{figures}; staleness {self.bound + 1} was over target lately"
        if under and dropping and self.bound < self.upper:
            self.bound += 1
            return "raise", f"{figures} under {config.raise_below:g} x target, " + (
                f"{self._dropped:.1%} dropped as stale"
            )
        return "hold", figures
