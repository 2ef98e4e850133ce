"""Rewards: rubric composition by hand-computed numbers, the arith criteria, and the reward
service end to end on a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import REGISTRY

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.domains.registry import rubric_for
from libs.reward import Criterion, Rubric, score_rollout
from libs.reward.rubric import CriterionError
from proto import streams, subjects
from proto.messages import (
    EPISODE_STAT_TRUNCATED_TURNS,
    DeadLetter,
    Rollout,
    ScoredRollout,
    Task,
    Turn,
)
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from tests.conftest import wait_for

TASK = Task(
    task_id="arith-d0-s0-1",
    env="arith",
    prompt="7=",
    spec={"answer": "7", "difficulty": 0, "max_tokens": 2},
)


def rollout(text: str, finish: str = "stop", rollout_id: str = "r1", env: str = "arith") -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        task_id=TASK.task_id,
        group_id=TASK.task_id,
        sample_index=0,
        env=env,
        turns=[
            Turn(role="user", token_ids=list(b"7="), text="7="),
            Turn(
                role="assistant",
                token_ids=list(text.encode()),
                text=text,
                logprobs=[-1.0] * len(text.encode()),
                policy_version=0,
            ),
        ],
        finish_reason=finish,  # type: ignore[arg-type]
        task=TASK,
    )


@pytest.mark.parametrize(
    ("text", "finish", "exact", "form", "reward"),
    [
        ("7", "stop", 1.0, 1.0, 1.0),  # right, and ended with eos
        ("7x", "length", 1.0, 0.0, 0.8),  # right up to the first non-digit, not well formed
        ("7", "length", 1.0, 0.0, 0.8),  # right, but the policy did not end it
        ("77", "length", 0.0, 0.0, 0.0),  # a digit first earns nothing by itself
        ("77", "stop", 0.0, 1.0, 0.2),  # well formed, wrong
        ("x7", "stop", 0.0, 0.0, 0.0),  # no digit first: nothing
        ("", "length", 0.0, 0.0, 0.0),
    ],
)
async def test_arith_rubric_scores_by_hand_computed_numbers(
    text: str, finish: str, exact: float, form: float, reward: float
) -> None:
    result = await rubric_for("arith").score(rollout(text, finish), TASK)
    breakdown = {c.name: (c.weight, c.score) for c in result.criteria}
    assert breakdown == {"exact_match": (0.8, exact), "format": (0.2, form)}
    assert result.reward == pytest.approx(reward)
    assert all(c.reason for c in result.criteria)


async def test_arith_uses_the_envs_verdict_and_a_cut_answer_is_not_well_formed() -> None:
    """The harness's rollouts: the env ended the episode ("stop") with its verdict; a final
    turn that max_tokens cut is counted in stats and earns no format credit."""
    ended = rollout("7", "stop")
    verdict = {"answer_correct": False, "expected": "7"}  # the env decides, not the text
    judged = Rollout(**{**_fields(ended), "env_info": verdict})
    cut = Rollout(**{**_fields(ended), "stats": {EPISODE_STAT_TRUNCATED_TURNS: 1.0}})
    rubric = rubric_for("arith")
    by_env = {c.name: c.score for c in (await rubric.score(judged, TASK)).criteria}
    by_cut = {c.name: c.score for c in (await rubric.score(cut, TASK)).criteria}
    assert by_env == {"exact_match": 0.0, "format": 1.0}
    assert by_cut == {"exact_match": 1.0, "format": 0.0}


def _fields(message: Rollout) -> dict[str, object]:
    return {name: getattr(message, name) for name in message.__struct_fields__}


async def test_rubric_reward_is_the_weighted_mean_of_its_criteria() -> None:
    rubric = Rubric(
        [
            Criterion("half", 1.0, lambda r, t: (0.5, "half")),
            Criterion("full", 3.0, lambda r, t: (1.0, "full")),
            Criterion("ignored", 0.0, lambda r, t: (0.0, "weight 0")),
        ]
    )
    result = await rubric.score(rollout("7"), TASK)
    assert result.reward == pytest.approx((1.0 * 0.5 + 3.0 * 1.0) / 4.0)  # 0.875
    assert [(c.name, c.weight, c.score, c.reason) for c in result.criteria] == [
        ("half", 1.0, 0.5, "half"),
        ("full", 3.0, 1.0, "full"),
        ("ignored", 0.0, 0.0, "weight 0"),
    ]


def test_bad_rubrics_are_refused() -> None:
    ok = Criterion("a", 1.0, lambda r, t: (1.0, ""))
    with pytest.raises(ValueError, match="unique"):
        Rubric([ok, ok])
    with pytest.raises(ValueError, match="positive weight"):
        Rubric([Criterion("a", 0.0, lambda r, t: (1.0, ""))])
    with pytest.raises(KeyError, match="unknown domain 'chess'"):
        rubric_for("chess")


async def test_a_failing_criterion_marks_the_rollout_unscored_never_a_silent_zero() -> None:
    def broken(r: Rollout, t: Task) -> tuple[float, str]:
        raise RuntimeError("judge unreachable")

    rubric = Rubric([Criterion("judge", 1.0, broken)])
    scored = await score_rollout(rubric, rollout("7"), TASK, now=1.0)
    assert not scored.scored and "judge" in scored.unscored_reason
    out_of_range = Rubric([Criterion("bad", 1.0, lambda r, t: (1.5, ""))])
    with pytest.raises(CriterionError, match="outside"):
        await out_of_range.score(rollout("7"), TASK)


@pytest.fixture
async def reward_service(bus: Bus) -> AsyncIterator[RewardService]:
    await provision(bus.js)
    service = RewardService(RewardSettings(fetch_timeout_s=0.2))
    await service.start(bus)
    running = asyncio.create_task(service.run())
    yield service
    await service.stop()
    await asyncio.wait_for(running, timeout=10)


async def stored(bus: Bus, stream: str) -> list[tuple[bytes, dict[str, str]]]:
    info = await bus.js.stream_info(stream)
    if info.state.messages == 0:
        return []
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(stream, seq)
        out.append((raw.data or b"", dict(raw.headers or {})))
    return out


async def num_stored(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).state.messages)


async def count_is(bus: Bus, stream: str, expected: int) -> bool:
    return await num_stored(bus, stream) == expected


async def all_handled(bus: Bus) -> bool:
    spec = streams.REWARD_ROLLOUTS
    info = await bus.js.consumer_info(spec.stream, spec.durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_raw_rollouts_come_out_scored_with_their_breakdown(
    bus: Bus, reward_service: RewardService
) -> None:
    publisher = Publisher(bus.js)
    raw = [rollout("7", "stop", "r-right"), rollout("3", "stop", "r-wrong")]
    for r in raw:
        await publisher.publish(subjects.rollout_raw_subject("arith"), r, msg_id=r.rollout_id)

    await wait_for(lambda: count_is(bus, streams.ROLLOUTS_SCORED.name, 2), what="2 scored")
    await wait_for(lambda: all_handled(bus), what="both raw rollouts acked")
    scored = {
        s.rollout.rollout_id: s
        for s in (
            wire.decode(ScoredRollout, data, headers)
            for data, headers in await stored(bus, streams.ROLLOUTS_SCORED.name)
        )
    }
    assert set(scored) == {"r-right", "r-wrong"}
    assert scored["r-right"].reward == pytest.approx(1.0) and scored["r-right"].scored
    assert scored["r-wrong"].reward == pytest.approx(0.2)
    assert [(c.name, c.score) for c in scored["r-wrong"].criteria] == [
        ("exact_match", 0.0),
        ("format", 1.0),
    ]
    assert scored["r-right"].rollout == raw[0]
    assert reward_service.health()["rollouts_scored"] == 2
    mean = REGISTRY.get_sample_value("rlpipe_reward_mean_reward", {"env": "arith"})
    assert mean == pytest.approx(0.6)


async def test_a_rollout_delivered_twice_is_scored_once(
    bus: Bus, reward_service: RewardService
) -> None:
    publisher = Publisher(bus.js)
    same = rollout("7", "stop", "r-dup")
    subject = subjects.rollout_raw_subject("arith")
    # The same publish retried (deduplicated by the raw stream), and the same rollout stored
    # twice under another id (what a redelivery after a crash looks like to reward).
    await publisher.publish(subject, same, msg_id="r-dup")
    await publisher.publish(subject, same, msg_id="r-dup")
    await publisher.publish(subject, same, msg_id="r-dup-again")
    assert await num_stored(bus, streams.ROLLOUTS_RAW.name) <= 2

    await wait_for(lambda: all_handled(bus), what="every raw copy handled")
    await wait_for(lambda: count_is(bus, streams.ROLLOUTS_SCORED.name, 1), what="1 scored")
    assert await num_stored(bus, streams.ROLLOUTS_SCORED.name) == 1
    assert reward_service.num_scored == 1


async def test_rollouts_of_unknown_envs_or_without_task_are_dead_lettered(
    bus: Bus, reward_service: RewardService
) -> None:
    publisher = Publisher(bus.js)
    chess = rollout("e4", "stop", "r-chess", env="chess")
    taskless = msgspec.structs.replace(rollout("7", "stop", "r-taskless"), task=None)
    good = rollout("7", "stop", "r-good")
    await publisher.publish(subjects.rollout_raw_subject("chess"), chess, msg_id="r-chess")
    for r in (taskless, good):
        await publisher.publish(subjects.rollout_raw_subject("arith"), r, msg_id=r.rollout_id)

    await wait_for(lambda: count_is(bus, streams.DEAD_LETTERS.name, 2), what="2 dead letters")
    await wait_for(lambda: all_handled(bus), what="every raw rollout handled")
    letters = [
        wire.decode(DeadLetter, data, headers)
        for data, headers in await stored(bus, streams.DEAD_LETTERS.name)
    ]
    assert {letter.reason for letter in letters} == {"rejected"}
    errors = " | ".join(letter.error for letter in letters)
    assert "unknown domain 'chess'" in errors and "no task" in errors
    scored = await stored(bus, streams.ROLLOUTS_SCORED.name)
    assert [wire.decode(ScoredRollout, d, h).rollout.rollout_id for d, h in scored] == ["r-good"]
