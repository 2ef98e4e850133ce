"""The trainer: cursor and groups by hand, a real step on the tiny policy, the loop on a real
bus, and a kill mid-run proving by sample ids that nothing is lost or trained twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import msgspec
import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Outgoing, Publisher, PublishError
from libs.engine.base import SamplingParams
from libs.engine.hf import HFEngine
from libs.nats_server import NatsServer, free_port
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.tokenizer import ByteTokenizer
from libs.trainer.checkpoint import TrainerState, latest_checkpoint, write_checkpoint
from libs.trainer.config import TrainerConfig
from libs.trainer.cursor import ConsumedCursor
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.groups import GroupBuffer
from libs.trainer.lineage import Lineage
from libs.trainer.loop import Trainer, checkpoint_dir
from libs.trainer.metrics import read_step_samples
from libs.trainer.pacing import PacingConfig
from libs.trainer.schedule import learning_rate_at
from libs.trainer.step import StepConfig, train_step
from proto import streams, subjects
from proto.messages import Rollout, ScoredRollout, Task, Turn, WeightsStaged
from tests.conftest import wait_for
from tests.marks import E2E

TOKENIZER = ByteTokenizer()


def scored(
    group: int, index: int, reward: float, answer: str = "7", version: int = 0, group_size: int = 4
) -> ScoredRollout:
    prompt = TOKENIZER.encode(f"{group % 10}=")
    completion = [*TOKENIZER.encode(answer), TOKENIZER.eos_id]
    task = Task(task_id=f"g{group}", env="arith", prompt="", group_size=group_size)
    rollout = Rollout(
        rollout_id=f"g{group}.{index}",
        task_id=f"g{group}",
        group_id=f"g{group}",
        sample_index=index,
        env="arith",
        turns=[
            Turn(role="user", token_ids=prompt),
            Turn(
                role="assistant",
                token_ids=completion,
                logprobs=[-1.0] * len(completion),
                policy_version=version,
            ),
        ],
        finish_reason="stop",
        task=task,
    )
    return ScoredRollout(rollout=rollout, reward=reward)


def test_cursor_floor_rises_over_contiguous_runs_and_remembers_gaps() -> None:
    cursor = ConsumedCursor()
    cursor.mark_done([2, 3, 5])
    assert (cursor.floor, cursor.done_runs) == (0, [(2, 3), (5, 5)])
    cursor.mark_done([1])
    assert (cursor.floor, cursor.done_runs) == (3, [(5, 5)])
    assert cursor.is_done(2) and cursor.is_done(5) and not cursor.is_done(4)
    restored = msgspec.json.decode(msgspec.json.encode(cursor), type=ConsumedCursor)
    assert restored == cursor


def test_cursor_stays_small_behind_one_sequence_held_back() -> None:
    # Sequence 1 waits in an open group while 100,000 later ones are consumed: one run.
    cursor = ConsumedCursor()
    for first in range(2, 100_002, 256):
        cursor.mark_done(range(first, first + 256))
    last = first + 255
    assert cursor.floor == 0 and cursor.num_runs == 1
    assert len(msgspec.json.encode(cursor)) < 100
    cursor.mark_done([1])
    assert cursor.floor == last and cursor.num_runs == 0


def test_cursor_of_an_older_checkpoint_loads_as_runs() -> None:
    cursor = msgspec.json.decode(b'{"floor": 3, "done": [5, 6, 8]}', type=ConsumedCursor)
    assert (cursor.floor, cursor.done_runs) == (3, [(5, 6), (8, 8)])


def test_groups_complete_at_their_size_ignore_duplicates_and_expire() -> None:
    buffer = GroupBuffer(incomplete_timeout_s=10)
    for index in range(3):
        buffer.add(index + 1, scored(1, index, 0.0), now_s=0.0)
    # A redelivered duplicate of sample 0 is reported, not buffered.
    assert buffer.add(9, scored(1, 0, 1.0), now_s=0.0) == "duplicate"
    buffer.add(4, scored(2, 0, 0.0), now_s=5.0)
    assert buffer.num_ready == 0
    buffer.add(10, scored(1, 3, 1.0), now_s=1.0)
    assert buffer.num_ready == 1
    buffer.expire(now_s=16.0)  # group 2 has waited 11 s for 3 missing samples
    groups = buffer.take(5)
    assert [g.group_id for g in groups] == ["g1", "g2"]
    assert groups[0].sequences == [1, 2, 3, 10] and buffer.num_expired == 1
    # A copy of a sample of a group already taken is a duplicate too, also after a resume.
    assert buffer.add(11, scored(1, 2, 1.0), now_s=20.0) == "duplicate"
    resumed = GroupBuffer(incomplete_timeout_s=10, taken=buffer.recently_taken)
    assert resumed.add(12, scored(2, 1, 1.0), now_s=20.0) == "duplicate"


def test_groups_put_back_are_taken_again_not_refused_as_duplicates() -> None:
    buffer = GroupBuffer(incomplete_timeout_s=10)
    for index in range(4):
        buffer.add(index + 1, scored(1, index, 0.0), now_s=0.0)
    taken = buffer.take(1)
    buffer.put_back(taken)  # a stop came before the step
    assert buffer.recently_taken == [] and buffer.num_ready == 1
    assert buffer.add(5, scored(1, 0, 0.0), now_s=0.0) == "duplicate"  # still buffered
    assert buffer.take(1)[0].sequences == [1, 2, 3, 4]


def test_a_refused_sample_counts_toward_its_group() -> None:
    buffer = GroupBuffer(incomplete_timeout_s=10)
    for index in range(3):
        buffer.add(index + 1, scored(1, index, 0.0), now_s=0.0)
    buffer.refuse(scored(1, 3, 0.0), now_s=0.0)
    (group,) = buffer.take(1)
    assert len(group.rollouts) == 3 and group.refused == {3}


def test_a_step_on_engine_samples_has_no_mismatch_and_favors_the_rewarded_answer() -> None:
    torch.manual_seed(0)
    model = build_policy(PolicyConfig(preset="tiny", seed=3))
    engine = HFEngine(model, TOKENIZER)
    prompt = TOKENIZER.encode("3=")
    completions = engine.generate([prompt], SamplingParams(max_tokens=3, seed=1), num_samples=4)
    samples = []
    for c in completions:
        rollout = scored(0, c.sample_index, 0.0).rollout
        rollout.turns = [
            Turn(role="user", token_ids=prompt),
            Turn(role="assistant", token_ids=c.token_ids, logprobs=c.logprobs, policy_version=0),
        ]
        samples.append(ScoredRollout(rollout=rollout, reward=1.0 if c.sample_index == 0 else 0.0))
    rewarded = torch.tensor([[*prompt, *completions[0].token_ids]])

    def rewarded_logprob() -> float:
        with torch.no_grad():
            return float(
                sequence_logprobs(model, rewarded, torch.ones_like(rewarded))[
                    0, len(prompt) - 1 :
                ].sum()
            )

    before = rewarded_logprob()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = train_step(model, optimizer, samples, 0, StepConfig(), TOKENIZER.pad_id)

    assert stats.mismatch.num_tokens == sum(len(c.token_ids) for c in completions)
    assert stats.mismatch.mean_abs_diff < 1e-5 and abs(stats.mismatch.kl) < 1e-6
    assert stats.policy.is_weight_mean == pytest.approx(1.0, abs=1e-4)
    assert rewarded_logprob() > before


def trainer_config(**overrides: object) -> TrainerConfig:
    fields: dict[str, object] = {
        "policy": PolicyConfig(preset="tiny"),
        "eval": EvalGateConfig(every_versions=0),
        "batch_groups": 2,
        "max_staleness": 1,
        "checkpoint_every_steps": 2,
    }
    fields.update(overrides)
    return TrainerConfig(**fields)  # type: ignore[arg-type]


async def publish_scored(bus: Bus, samples: list[ScoredRollout]) -> None:
    await Publisher(bus.js).publish_many(
        Outgoing(subjects.ROLLOUTS_SCORED, s, msg_id=s.rollout.rollout_id) for s in samples
    )


async def announce_version(bus: Bus, version: int) -> None:
    """Record `version` as the newest made, as an earlier trainer run would have."""
    kv = await bus.js.key_value(streams.STATE.bucket)
    await kv.put(streams.POLICY_VERSION_KEY, str(version).encode())


def read_steps(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "trainer" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """Each step's sample ids (trainer/step_samples.jsonl), as the trainer's reader reads them."""
    return [msgspec.to_builtins(record) for record in read_step_samples(run_dir)]


async def run_two_steps(bus: Bus, run_dir: Path) -> Trainer:
    """A trainer that checkpoints every 2 steps, run to its bound of 2 on 2 batches."""
    await provision(bus.js)
    trainer = Trainer(trainer_config(max_steps=2), run_dir, bus, Publisher(bus.js))
    await trainer.setup()
    version = trainer.state.version
    await publish_scored(
        bus, [scored(g, i, float(i % 2), version=version) for g in range(4) for i in range(4)]
    )
    await trainer.run()
    return trainer


def counting_writes(fail_first: bool = False) -> tuple[list[int], Callable[..., Path]]:
    """libs.trainer.checkpointer's write_checkpoint, recording each written step (the first one
    raising OSError when `fail_first`)."""
    written: list[int] = []

    def write(directory: Path, state: TrainerState, *args: Any, **kwargs: Any) -> Path:
        if fail_first and not written:
            written.append(-state.step)
            raise OSError(28, "No space left on device")
        written.append(state.step)
        return write_checkpoint(directory, state, *args, **kwargs)

    return written, write


async def test_the_last_step_is_checkpointed_once(bus: Bus, tmp_path: Path) -> None:
    written, write = counting_writes()
    with patch("libs.trainer.checkpointer.write_checkpoint", write):
        await run_two_steps(bus, tmp_path)
    assert written == [2], "step 2's own checkpoint is the final one: not written again at stop"


async def test_a_failed_background_checkpoint_still_ends_with_one_and_the_records(
    bus: Bus, tmp_path: Path
) -> None:
    written, write = counting_writes(fail_first=True)
    with (
        patch("libs.trainer.checkpointer.write_checkpoint", write),
        pytest.raises(OSError, match="space"),
    ):
        await run_two_steps(bus, tmp_path)
    assert written == [-2, 2], "the failed write raised at stop, after the in-line retry"
    assert latest_checkpoint(tmp_path / "trainer" / "checkpoints").state.step == 2
    assert [s["step"] for s in read_steps(tmp_path)] == [1, 2]


async def test_trainer_steps_on_groups_drops_stale_samples_and_stages_each_version(
    bus: Bus, tmp_path: Path
) -> None:
    await provision(bus.js)
    await announce_version(bus, 10)  # a trainer resumed after version 10 starts at 11
    trainer = Trainer(trainer_config(max_steps=2), tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    assert trainer.state.version == 11
    samples = [scored(g, i, float(i % 2), version=11) for g in range(3) for i in range(4)]
    samples += [scored(3, i, float(i % 2), version=6) for i in range(4)]  # far too stale
    samples += [scored(4, i, float(i % 2), version=11) for i in range(4)]
    await publish_scored(bus, samples)
    await trainer.run()

    steps, samples = read_steps(tmp_path), read_samples(tmp_path)
    assert [s["step"] for s in steps] == [1, 2] and [s["version"] for s in steps] == [12, 13]
    assert [s["step"] for s in samples] == [1, 2]
    assert samples[0]["sample_ids"] == [f"g{g}.{i}" for g in (0, 1) for i in range(4)]
    # A stale group does not shrink the step: it is dropped and the next fresh one taken.
    assert samples[1]["sample_ids"] == [f"g{g}.{i}" for g in (2, 4) for i in range(4)]
    assert samples[1]["dropped_ids"] == [f"g3.{i}" for i in range(4)]
    # The step record is readable by eye: figures, the learning rate, no ids.
    assert "sample_ids" not in steps[0]
    rates = [learning_rate_at(trainer.config, step) for step in (0, 1)]
    assert [s["learning_rate"] for s in steps] == pytest.approx(rates)
    assert steps[1]["staleness"] == {"1": 8, "6": 4} and steps[1]["num_dropped"] == 4
    info = await bus.js.stream_info(streams.WEIGHTS_STAGED.name)
    assert info.state.messages == 3  # versions 11, 12, 13
    last = await bus.js.get_last_msg(streams.WEIGHTS_STAGED.name, subjects.WEIGHTS_STAGED)
    assert msgspec.msgpack.decode(last.data or b"", type=WeightsStaged).version == 13
    kv = await bus.js.key_value(streams.STATE.bucket)
    assert (await kv.get("policy_version")).value == b"13"
    assert (await kv.get("trainer_groups_taken")).value == b"5"
    assert (tmp_path / "trainer" / "checkpoints" / "step-00000002" / "model.safetensors").exists()


async def test_a_version_that_fails_to_stage_stops_the_trainer_waiting_for_samples(
    bus: Bus, tmp_path: Path
) -> None:
    """The staged-weights stream is gone after the first version: step 1's version cannot
    be handed over. The workers would wait for it and send nothing more, so the trainer,
    waiting for samples, stops with the handover's error (to be restarted) rather than
    waiting forever."""
    await provision(bus.js)
    publisher = Publisher(bus.js, max_attempts=1, retry_window_s=0.0)
    trainer = Trainer(trainer_config(max_steps=5), tmp_path, bus, publisher)
    await trainer.setup()
    await bus.js.delete_stream(streams.WEIGHTS_STAGED.name)
    await publish_scored(bus, [scored(g, i, float(i % 2)) for g in range(2) for i in range(4)])
    running = asyncio.create_task(trainer.run())
    await asyncio.wait([running], timeout=120)  # a deadline against a hang only
    if not running.done():  # waiting for samples that cannot come
        await trainer.stop()
        await asyncio.gather(running, return_exceptions=True)
        pytest.fail("the trainer waited on with its version unstaged")
    with pytest.raises(PublishError, match=r"rl\.weights\.staged"):
        running.result()
    assert [s["step"] for s in read_steps(tmp_path)] == [1]


@E2E
async def test_trainer_killed_mid_run_resumes_without_losing_or_repeating_samples(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    await provision(bus.js)
    num_groups = 24
    published = [scored(g, i, float((g + i) % 3 == 0)) for g in range(num_groups) for i in range(4)]
    await publish_scored(bus, published)
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_TRAINER_HTTP_PORT": str(free_port()),
        "RLPIPE_TRAINER_BATCH_GROUPS": "2",
        "RLPIPE_TRAINER_CHECKPOINT_EVERY_STEPS": "3",
        "RLPIPE_TRAINER_MAX_STALENESS": "1000",
        "RLPIPE_LOG_FORMAT": "json",
    }
    first = subprocess.Popen(
        [sys.executable, "-m", "services.trainer"], env=env, stderr=subprocess.DEVNULL
    )
    try:
        # A checkpoint is written in the background: on a busy machine step 5 can come before
        # step 3's checkpoint is in place, and then there is nothing to resume from.
        await wait_for(
            lambda: (
                len(read_steps(tmp_path)) >= 5
                and latest_checkpoint(checkpoint_dir(tmp_path)) is not None
            ),
            timeout_s=240,
            what="five steps and a checkpoint",
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps_at_kill = len(read_steps(tmp_path))

    env["RLPIPE_TRAINER_MAX_STEPS"] = str(num_groups // 2)
    second = subprocess.run(
        [sys.executable, "-m", "services.trainer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr[-2000:]

    records = read_samples(tmp_path)
    assert max(r["segment"] for r in records) == 1, "the second run resumed from a checkpoint"
    # The history that counts: for each step, the record of the latest segment.
    effective = {record["step"]: record for record in records}
    assert sorted(effective) == list(range(1, num_groups // 2 + 1))
    trained = [sid for r in effective.values() for sid in r["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == sorted(s.rollout.rollout_id for s in published), "a sample was lost"
    # The second run started from a checkpoint (every 3 steps); the first run's steps after
    # it were lost with the kill and done again.
    resumed_from = min(int(r["step"]) for r in records if r["segment"] == 1) - 1
    assert resumed_from >= 3 and resumed_from % 3 == 0 and resumed_from <= steps_at_kill
    superseded = [r for r in records if r["segment"] == 0 and int(r["step"]) > resumed_from]
    assert len(records) == len(effective) + len(superseded)


async def test_groups_dropped_while_waiting_are_reported_to_the_feeder(
    bus: Bus, tmp_path: Path
) -> None:
    await provision(bus.js)
    await announce_version(bus, 10)
    trainer = Trainer(trainer_config(), tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    await publish_scored(bus, [scored(g, i, 1.0, version=0) for g in range(2) for i in range(4)])
    running = asyncio.create_task(trainer.run())
    kv = await bus.js.key_value(streams.STATE.bucket)

    async def taken_is_two() -> bool:
        return (await kv.get("trainer_groups_taken")).value == b"2"

    # No step can happen (every sample is too stale), yet the feeder learns the groups are gone.
    await wait_for(taken_is_two, what="the dropped groups counted as taken")
    await trainer.stop()
    await running
    assert trainer.state.step == 0


async def test_the_pacer_lowers_the_bound_on_mismatch_and_every_step_records_why(
    bus: Bus, tmp_path: Path
) -> None:
    """Samples logged at logprob -1 where the tiny policy gives about -5.5: every token is far
    off-policy (importance weight ~0.01), so the pacer lowers the bound after step 1, and step
    2 drops a group that bound 3 would have kept; the feeder reads the new bound."""
    await provision(bus.js)
    await announce_version(bus, 10)  # the trainer starts at version 11
    pacing = PacingConfig(
        enabled=True, min_staleness=1, max_staleness=3, hold_steps=0, min_tokens=1
    )
    config = trainer_config(max_steps=2, max_staleness=3, pacing=pacing)
    trainer = Trainer(config, tmp_path, bus, Publisher(bus.js))
    await trainer.setup()
    # Step 1 (version 11): staleness 0 and 2. Step 2 (version 12): 1, 2 dropped, 1.
    versions = {0: 11, 1: 9, 2: 11, 3: 10, 4: 11}
    await publish_scored(
        bus, [scored(g, i, float(i % 2), version=v) for g, v in versions.items() for i in range(4)]
    )
    await trainer.run()

    first, second = read_steps(tmp_path)
    tokens = 8  # 4 samples of a group x 2 completion tokens
    by_staleness: Any = first["mismatch_by_staleness"]
    assert {b: f["tokens"] for b, f in by_staleness.items()} == {
        "0": tokens,
        "2": tokens,
        "all": 16,
    }
    assert by_staleness["2"]["is_outside_fraction"] == 1.0 and by_staleness["2"]["kl"] > 1.0
    assert first["max_staleness"] == 3
    assert first["pacing"]["action"] == "lower" and first["pacing"]["signal_staleness"] == 2
    assert (first["pacing"]["bound_before"], first["pacing"]["bound_after"]) == (3, 1)
    assert second["max_staleness"] == 1 and second["num_dropped"] == 4
    assert second["pacing"]["action"] == "hold", "at min_staleness already"
    assert read_samples(tmp_path)[1]["dropped_ids"] == [f"g3.{i}" for i in range(4)]
    kv = await bus.js.key_value(streams.STATE.bucket)
    assert (await kv.get(streams.MAX_STALENESS_KEY)).value == b"1"


async def test_without_pacing_the_bound_stays_and_is_recorded(bus: Bus, tmp_path: Path) -> None:
    await run_two_steps(bus, tmp_path)
    steps = read_steps(tmp_path)
    assert [s["max_staleness"] for s in steps] == [1, 1]
    assert [s["pacing"] for s in steps] == [None, None]
    # Every sample of version 0: fresh at step 1, a version old at step 2.
    buckets: list[Any] = [s["mismatch_by_staleness"] for s in steps]
    assert [sorted(b) for b in buckets] == [["0", "all"], ["1", "all"]]


def test_learning_rate_decays_linearly_to_its_floor_and_stays() -> None:
    config = trainer_config(
        learning_rate=1e-3, learning_rate_decay_steps=100, min_learning_rate_ratio=0.1
    )
    rates = [learning_rate_at(config, step) for step in (0, 50, 100, 200)]
    assert rates == pytest.approx([1e-3, 5.5e-4, 1e-4, 1e-4])
    constant = trainer_config(learning_rate=2e-4, learning_rate_decay_steps=None)
    assert learning_rate_at(constant, 10_000) == 2e-4


def test_staleness_after_a_resume_counts_updates_not_version_numbers() -> None:
    # Checkpoint version 10, crashed at 18, resumed as 19 (19 holds 10's weights).
    lineage = Lineage().resumed(10, 19)
    staleness = {v: 19 - lineage.equivalent(v) for v in (10, 8, 13, 18, 19)}
    assert staleness == {10: 0, 8: 2, 13: 3, 18: 8, 19: 0}
    later = lineage.resumed(25, 31)  # another crash: 31 holds 25's weights
    assert 31 - later.equivalent(24) == 1 and 31 - later.equivalent(20) == 5
    assert later.equivalent(5) == 5  # before the earlier resume: counted plainly
