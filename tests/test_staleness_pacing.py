"""Staleness paced by the signal: the mismatch of every trained token by its staleness, the
masked importance weight (libs/rl), and the pacer's decisions on synthetic signals
(libs/trainer/pacing.py). The pacer inside the trainer loop, on a real bus, is in
tests/test_trainer.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pydantic
import pytest
import torch

from libs.rl import (
    NO_VERSION,
    mismatch_by_staleness,
    ppo_clip_loss,
    staleness_buckets,
    token_staleness,
)
from libs.trainer.lineage import Lineage
from libs.trainer.pacing import PacingConfig, StalenessPacer
from libs.trainer.samples import versions_reachable

LN = math.log


def k3(diff: float) -> float:
    """w - 1 - log w with log w = diff."""
    return math.exp(diff) - 1 - diff


def test_token_staleness_counts_versions_and_marks_untrained_tokens_negative() -> None:
    versions = torch.tensor([[NO_VERSION, 7, 7], [5, 3, NO_VERSION]])
    assert token_staleness(versions, 7).tolist() == [[-1, 0, 0], [2, 4, -1]]
    # Resumed: version 10's weights announced as 19, so a token of version 10 is fresh.
    lineage = Lineage().resumed(10, 19)
    assert token_staleness(torch.tensor([[10, 19, 18, NO_VERSION]]), 19, lineage.equivalent)[
        0
    ].tolist() == [0, 0, 8, -1]


def test_every_trained_token_is_measured_by_its_staleness() -> None:
    # Trainer at version 9; tokens of versions 9 (fresh), 8, 6 and 2, and one not trained.
    versions = torch.tensor([[9, 9, 8, 6], [2, 2, 8, NO_VERSION]])
    loss_mask = versions != NO_VERSION
    behavior = torch.zeros(2, 4)
    # proximal - behavior per token: 0 for the fresh ones, then growing with staleness.
    diffs = [[0.0, 0.0, LN(1.5), LN(3.0)], [LN(0.25), LN(4.0), -LN(1.5), 99.0]]
    proximal = torch.tensor(diffs)
    levels = mismatch_by_staleness(
        proximal, behavior, token_staleness(versions, 9), loss_mask, band=2.0
    )

    assert sorted(levels) == [0, 1, 3, 7], "every trained token counts; the untrained does not"
    assert levels[0].num_tokens == 2 and levels[0].kl == pytest.approx(0.0, abs=1e-7)
    assert levels[0].is_weight_mean == pytest.approx(1.0)
    one = levels[1]  # weights 1.5 and 1/1.5: inside the band of 2
    assert one.num_tokens == 2 and one.is_outside_fraction == 0.0
    assert one.kl == pytest.approx((k3(LN(1.5)) + k3(-LN(1.5))) / 2, rel=1e-5)
    assert one.mean_abs_diff == pytest.approx(LN(1.5), rel=1e-5)
    assert one.is_weight_mean == pytest.approx((1.5 + 1 / 1.5) / 2, rel=1e-5)
    assert levels[3].is_outside_fraction == 1.0  # weight 3
    seven = levels[7]  # weights 1/4 and 4: both outside [1/2, 2]
    assert seven.num_tokens == 2 and seven.is_outside_fraction == 1.0
    assert seven.kl == pytest.approx((k3(LN(0.25)) + k3(LN(4.0))) / 2, rel=1e-5)

    buckets = staleness_buckets(levels)
    assert list(buckets) == ["0", "1", "3+", "all"], "no token 2 versions old: no bucket"
    assert buckets["3+"].num_tokens == 3 and buckets["all"].num_tokens == 7
    assert buckets["3+"].kl == pytest.approx((k3(LN(3.0)) + 2 * seven.kl) / 3, rel=1e-5)
    assert buckets["all"].is_outside_fraction == pytest.approx(3 / 7)


def test_no_trained_token_gives_no_level() -> None:
    versions = torch.tensor([[NO_VERSION, 4]])
    levels = mismatch_by_staleness(
        torch.zeros(1, 2), torch.zeros(1, 2), token_staleness(versions, 4), versions < 0
    )
    assert levels == {} and staleness_buckets(levels) == {}


def test_the_masked_weight_keeps_tokens_inside_the_band_and_drops_the_rest() -> None:
    # Weights exp(prox - behavior): 1.5 (inside [1/2, 2]), 3 (above), 1/3 (below), 1.
    behavior = torch.zeros(1, 4)
    proximal = torch.tensor([[LN(1.5), LN(3.0), -LN(3.0), 0.0]])
    new = proximal.clone().requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    advantages = torch.tensor([1.0])
    masked, stats = ppo_clip_loss(
        new, proximal, behavior, advantages, mask, is_cap=2.0, correction="mask"
    )
    masked.backward()
    assert new.grad is not None
    # d(-w * r * A / 4)/d new = -w * A / 4 at r = 1; tokens outside the band get nothing.
    assert new.grad[0].tolist() == pytest.approx([-1.5 / 4, 0.0, 0.0, -1.0 / 4])
    assert stats.is_truncated_fraction == 0.5, "the two masked tokens"
    assert stats.is_weight_min == 0.0 and stats.is_weight_max == pytest.approx(1.5)
    # Truncation instead pushes the token above the band at the cap and keeps the one below.
    new = proximal.clone().requires_grad_(True)
    truncated, stats = ppo_clip_loss(new, proximal, behavior, advantages, mask, is_cap=2.0)
    truncated.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([-1.5 / 4, -2.0 / 4, -1 / 3 / 4, -1.0 / 4])
    assert stats.is_truncated_fraction == 0.25


def test_an_unknown_correction_is_refused_by_name() -> None:
    ones = torch.ones(1, 2)
    with pytest.raises(ValueError, match="correction"):
        ppo_clip_loss(ones, ones, ones, torch.ones(1), ones.bool(), correction="clip")  # type: ignore[arg-type]


@dataclass
class Level:
    """A staleness level's measurement, as libs.rl.MismatchStats carries it."""

    kl: float
    is_outside_fraction: float = 0.0
    num_tokens: int = 512


def pacing(**overrides: object) -> PacingConfig:
    fields: dict[str, object] = {
        "enabled": True,
        "min_staleness": 1,
        "max_staleness": 6,
        "target_kl": 0.05,
        "target_outside_fraction": 0.1,
        "smoothing_steps": 1,  # no smoothing: each step's figure is the signal
        "hold_steps": 0,
        "min_tokens": 32,
    }
    fields.update(overrides)
    return PacingConfig(**fields)


def test_the_bound_goes_below_the_first_level_over_the_target() -> None:
    pacer = StalenessPacer(pacing(), start=4)
    decision = pacer.observe(1, {0: Level(0.0), 2: Level(0.01), 4: Level(0.2)}, 256, 0)
    assert (decision.action, decision.bound_before, decision.bound_after) == ("lower", 4, 3)
    assert decision.signal_staleness == 4 and decision.signal_kl == pytest.approx(0.2)
    assert "over target" in decision.reason
    # The samples now reach only staleness 2, still over the target: one below it.
    decision = pacer.observe(2, {0: Level(0.0), 2: Level(0.3)}, 256, 0)
    assert (decision.action, pacer.bound) == ("lower", 1)
    # Never below min_staleness, however bad.
    decision = pacer.observe(3, {1: Level(5.0)}, 256, 0)
    assert (decision.action, pacer.bound) == ("hold", 1)


def test_the_importance_weight_spread_alone_lowers_the_bound() -> None:
    pacer = StalenessPacer(pacing(), start=3)
    decision = pacer.observe(1, {3: Level(0.01, is_outside_fraction=0.3)}, 256, 0)
    assert (decision.action, pacer.bound) == ("lower", 2)


def test_the_bound_rises_only_when_well_under_target_and_samples_are_dropped() -> None:
    pacer = StalenessPacer(pacing(), start=2)
    calm = {0: Level(0.0), 2: Level(0.01, 0.01)}
    assert pacer.observe(1, calm, 256, 0).action == "hold", "nothing dropped: no reason to"
    decision = pacer.observe(2, calm, 192, 64)
    assert (decision.action, pacer.bound) == ("raise", 3)
    assert "dropped as stale" in decision.reason
    # Between the raise and lower thresholds: held, though samples are dropped.
    decision = pacer.observe(3, {3: Level(0.04)}, 192, 64)
    assert (decision.action, pacer.bound) == ("hold", 3)
    for step in range(4, 10):  # never above max_staleness
        pacer.observe(step, {pacer.bound: Level(0.0)}, 128, 128)
    assert pacer.bound == 6


def test_the_bound_is_not_raised_back_into_a_level_just_found_over_target() -> None:
    pacer = StalenessPacer(pacing(smoothing_steps=2), start=3)  # figures fresh for 6 steps
    assert pacer.observe(1, {2: Level(0.01), 3: Level(0.2)}, 256, 0).action == "lower"
    calm = {2: Level(0.01)}  # well under target, and a third of the samples dropped
    decision = pacer.observe(2, calm, 128, 64)
    assert (decision.action, pacer.bound) == ("hold", 2)
    assert "staleness 3 was over target lately" in decision.reason
    # Once staleness 3's figure is older than 3 horizons it no longer holds the bound back.
    actions = [pacer.observe(step, calm, 128, 64).action for step in range(3, 9)]
    assert actions[-1] == "raise" and pacer.bound == 3


def test_after_a_change_the_bound_holds_then_moves_again() -> None:
    pacer = StalenessPacer(pacing(hold_steps=3), start=5)
    high = {5: Level(0.5), 4: Level(0.5), 3: Level(0.5)}
    assert pacer.observe(10, high, 256, 0).action == "lower"
    assert [pacer.observe(step, high, 256, 0).action for step in (11, 12)] == ["wait", "wait"]
    assert pacer.bound == 4
    assert pacer.observe(13, high, 256, 0).action == "lower" and pacer.bound == 3


def test_a_signal_that_crosses_the_target_once_is_smoothed_away() -> None:
    pacer = StalenessPacer(pacing(smoothing_steps=9), start=4)  # alpha 0.2
    decisions = [pacer.observe(s, {4: Level(0.02)}, 256, 0).action for s in range(5)]
    assert set(decisions) == {"hold"}
    # One step at 3x the target: the average moves to 0.02 + 0.2 * (0.15 - 0.02) = 0.046.
    decision = pacer.observe(5, {4: Level(0.15)}, 256, 0)
    assert decision.action == "hold" and decision.signal_kl == pytest.approx(0.046)
    # Sustained, it lowers the bound.
    actions = [pacer.observe(s, {4: Level(0.15)}, 256, 0).action for s in range(6, 9)]
    assert "lower" in actions and pacer.bound == 3


def test_levels_with_few_tokens_or_measured_long_ago_are_no_signal() -> None:
    pacer = StalenessPacer(pacing(smoothing_steps=2), start=3)
    decision = pacer.observe(1, {3: Level(0.9, num_tokens=5)}, 256, 0)
    assert decision.action == "no_signal" and pacer.bound == 3
    pacer.observe(2, {1: Level(0.0)}, 256, 0)
    # 3 horizons (6 steps) later, level 1's figure no longer describes the policy.
    assert pacer.observe(9, {}, 256, 0).action == "no_signal"


def test_the_start_is_clamped_into_the_limits_and_the_limits_must_be_ordered() -> None:
    assert StalenessPacer(pacing(), start=8).bound == 6
    assert StalenessPacer(pacing(min_staleness=2), start=1).bound == 2
    # Unset, the ceiling is the trainer's own bound: pacing never allows more than it.
    unset = StalenessPacer(pacing(max_staleness=None, min_staleness=2), start=20)
    assert (unset.bound, unset.upper) == (20, 20)
    assert StalenessPacer(pacing(max_staleness=None, min_staleness=2), start=1).bound == 1
    with pytest.raises(pydantic.ValidationError, match="min_staleness"):
        pacing(min_staleness=4, max_staleness=3)


def test_the_trainer_holds_samples_back_only_while_no_fresh_enough_version_is_offered() -> None:
    # Bound 8: samples of a version up to 7 behind stay trainable.
    assert versions_reachable(20, [], max_staleness=8, publish_every_steps=1)  # no broadcaster
    assert versions_reachable(20, [13], max_staleness=8, publish_every_steps=1)
    assert not versions_reachable(20, [12], max_staleness=8, publish_every_steps=1)
    # The chain far behind, this host's workers taking version 19 from the trainer's memory.
    assert versions_reachable(20, [12, 19], max_staleness=8, publish_every_steps=1)
    # Versions published every 4 steps: up to 3 behind is expected however low the bound.
    assert versions_reachable(20, [17], max_staleness=0, publish_every_steps=4)
    assert not versions_reachable(20, [16], max_staleness=0, publish_every_steps=4)
