"""trainer.zero_variance_groups: groups whose samples all got the same reward fill the batch
("train", the default) or are consumed without training while the step waits for groups
whose rewards differ ("skip", DAPO's dynamic sampling). The trainer loop on a real bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.rl import group_advantages, group_index, has_reward_variance
from libs.trainer.checkpoint import latest_checkpoint
from libs.trainer.loop import Trainer, checkpoint_dir
from proto import streams
from proto.messages import ScoredRollout
from tests.conftest import wait_for
from tests.test_trainer import publish_scored, read_samples, read_steps, scored, trainer_config

# Rewards of each group published, in order: the all-success ones carry no signal.
ALL_SUCCESS, MIXED = [1.0] * 4, [0.0, 1.0, 0.0, 1.0]
GROUP_REWARDS = [ALL_SUCCESS, MIXED, ALL_SUCCESS, MIXED]


def solved(group: int, index: int, reward: float, group_size: int = 4) -> ScoredRollout:
    """A sample whose environment said the answer is right when the reward is 1."""
    sample = scored(group, index, reward, group_size=group_size)
    info = {"answer_correct": reward == 1.0}
    return msgspec.structs.replace(
        sample, rollout=msgspec.structs.replace(sample.rollout, env_info=info)
    )


def group_samples(rewards: list[list[float]]) -> list[ScoredRollout]:
    return [solved(g, i, r) for g, group in enumerate(rewards) for i, r in enumerate(group)]


def ids(*groups: int) -> list[str]:
    return [f"g{g}.{i}" for g in groups for i in range(4)]


async def run_one_step(bus: Bus, run_dir: Path, **config: object) -> None:
    """A trainer of 2 groups a step run for one step on GROUP_REWARDS."""
    await provision(bus.js)
    trainer = Trainer(
        trainer_config(max_steps=1, checkpoint_every_steps=1, **config),
        run_dir,
        bus,
        Publisher(bus.js),
    )
    await trainer.setup()
    await publish_scored(bus, group_samples(GROUP_REWARDS))
    await trainer.run()


def test_reward_variance_agrees_with_the_zero_advantage_groups() -> None:
    groups = [[1.0, 1.0], [0.3, 0.3 + 1e-7], [0.0, 1.0], [0.5]]
    rewards = torch.tensor([r for group in groups for r in group])
    index = group_index([g for g, group in enumerate(groups) for _ in group])
    zero = group_advantages(rewards, index).zero_variance
    per_group = [bool(zero[index == g].all()) for g in range(len(groups))]
    assert [not has_reward_variance(group) for group in groups] == per_group
    assert per_group == [True, True, False, True]


async def test_skip_trains_only_groups_whose_rewards_differ(bus: Bus, tmp_path: Path) -> None:
    await run_one_step(bus, tmp_path, zero_variance_groups="skip")

    [step], [samples] = read_steps(tmp_path), read_samples(tmp_path)
    assert samples["sample_ids"] == ids(1, 3), "the batch waited for two groups with signal"
    assert samples["skipped_ids"] == ids(0, 2) and samples["dropped_ids"] == []
    assert step["num_groups"] == 2 and step["num_samples"] == 8
    assert step["num_skipped_groups"] == 2 and step["num_zero_variance_groups"] == 0
    # The curve reports what the policy did: the skipped all-success groups count.
    assert step["mean_reward"] == pytest.approx(12 / 16)
    assert step["success"] == pytest.approx(12 / 16)
    kv = await bus.js.key_value(streams.STATE.bucket)
    assert (await kv.get("trainer_groups_taken")).value == b"4", "the feeder counts them taken"
    # Consumed: a resumed trainer starts after every sample of the step, skipped ones too.
    checkpoint = latest_checkpoint(checkpoint_dir(tmp_path))
    assert checkpoint is not None and checkpoint.state.scored_cursor.floor == 16


async def test_train_fills_the_batch_with_zero_variance_groups_as_before(
    bus: Bus, tmp_path: Path
) -> None:
    await run_one_step(bus, tmp_path)

    [step], [samples] = read_steps(tmp_path), read_samples(tmp_path)
    assert samples["sample_ids"] == ids(0, 1) and samples["skipped_ids"] == []
    assert step["num_groups"] == 2 and step["num_zero_variance_groups"] == 1
    assert step["num_skipped_groups"] == 0
    assert step["mean_reward"] == pytest.approx(6 / 8)
    checkpoint = latest_checkpoint(checkpoint_dir(tmp_path))
    assert checkpoint is not None and checkpoint.state.scored_cursor.floor == 8


async def test_skip_trains_groups_of_one_sample(bus: Bus, tmp_path: Path) -> None:
    """A group of size 1 never has variance: skipping it would starve the run."""
    await provision(bus.js)
    config = trainer_config(max_steps=1, zero_variance_groups="skip")
    trainer = Trainer(config, tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    await publish_scored(bus, [solved(g, 0, 1.0, group_size=1) for g in range(2)])
    await trainer.run()

    [step], [samples] = read_steps(tmp_path), read_samples(tmp_path)
    assert samples["sample_ids"] == ["g0.0", "g1.0"] and step["num_skipped_groups"] == 0


async def test_skipped_groups_are_reported_to_the_feeder_while_the_step_waits(
    bus: Bus, tmp_path: Path
) -> None:
    await provision(bus.js)
    trainer = Trainer(trainer_config(zero_variance_groups="skip"), tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    await publish_scored(bus, group_samples([ALL_SUCCESS, [0.0] * 4]))
    running = asyncio.create_task(trainer.run())
    kv = await bus.js.key_value(streams.STATE.bucket)

    # No step can happen (no group has signal), yet the feeder learns the groups are gone
    # (counted before the health answer says why the step waits).
    await wait_for(
        lambda: "2 groups skipped" in trainer.health()["detail"],
        what="the health answer saying the step waits for groups with signal",
    )
    assert (await kv.get("trainer_groups_taken")).value == b"2"
    await trainer.stop()
    await running
    assert trainer.state.step == 0 and read_steps(tmp_path) == []
