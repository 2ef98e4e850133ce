"""End to end on a real nats-server: episodes of the multi-turn environments (calc, coding)
run through env-gateway, a rollout worker (tiny random-init policy, byte tokenizer), the
weight-broadcaster, reward and the trainer, all in-process on one bus.

Issue #5's first "done when": each built-in environment's episodes are rolled out,
rewarded with its rubric and trained on (arith is covered by test_learning_e2e). The
coding env runs its tools and grading in bubblewrap sandboxes, so this module skips where
`bwrap` is missing. A self-summarizing calc episode goes the same way, and the trainer
trains on one row per context segment.

A random-init policy writes no tool calls, so in calc and coding its first turn is its final
answer (tool calls are covered with a scripted policy in test_agent_harness.py). The
summarizing episode runs in `journal`, an environment plugged in by this test (plug-in API:
a Domain registered in the process) that asks for an entry per turn until max_turns, so the
context grows past the budget, the policy summarizes, and the episode goes on in a new
segment.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

import libs.trainer.step
from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.domains import registry
from libs.domains.calc.env import CalcTasks
from libs.domains.coding import CodingTasks
from libs.domains.domain import Domain
from libs.envs.base import Environment, Episode, Opening, StepResult
from libs.envs.feeder import FeederConfig
from libs.policy import PolicyConfig
from libs.reward.criteria import turn_penalty
from libs.reward.rubric import Criterion, Rubric
from libs.rl.batch import TrainBatch, build_batch
from libs.rollout.agent import SUMMARY_REQUEST
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.metrics import StepRecord, StepSamples, read_step_samples, read_steps
from libs.weights.encoder import EncodeOptions
from proto import messages as m
from proto import streams
from proto.messages import ScoredRollout, Task
from proto.subjects import task_subject
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.marks import E2E

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    E2E,
]

TOKENIZER = ByteTokenizer()
GROUP = 2
CODING_MAX_TOKENS = 24  # per turn; calc's opening fixes its own (256)
TIMEOUT_S = 60.0
JOURNAL_TURNS = 8
JOURNAL_MAX_TOKENS = 48
JOURNAL_BUDGET = 600


@dataclass
class Pipeline:
    """The five services on one bus, and what the test reads back from them."""

    bus: Bus
    run_dir: Path
    running: list[tuple[Service, asyncio.Task[None]]] = field(default_factory=list)

    async def start(self, service: Service) -> None:
        await service.start(self.bus)
        self.running.append((service, asyncio.create_task(service.run(), name=service.name)))

    async def start_all(self, **worker_settings: object) -> None:
        run_dir = self.run_dir
        await self.start(EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off"))))
        await self.start(
            WeightBroadcasterService(
                WeightBroadcasterSettings(run_dir=run_dir, encode=EncodeOptions(threads=1))
            )
        )
        await self.start(
            RolloutWorkerService(
                RolloutWorkerSettings(
                    worker_id="worker-e2e",
                    policy=PolicyConfig(device="cpu"),
                    max_batch_tasks=4,
                    fetch_timeout_s=0.2,
                    drain_timeout_s=5.0,
                    **{"max_turns": 3, **worker_settings},  # type: ignore[arg-type]
                )
            )
        )
        await self.start(RewardService(RewardSettings(fetch_timeout_s=0.2)))
        await self.start(
            TrainerService(
                TrainerSettings(
                    run_dir=run_dir,
                    policy=PolicyConfig(device="cpu"),
                    batch_groups=1,
                    max_staleness=100,
                    eval=EvalGateConfig(every_versions=0),
                    checkpoint_every_steps=1000,
                )
            )
        )

    async def stop_all(self) -> None:
        for service, task in reversed(self.running):
            await service.stop()
            await asyncio.wait_for(task, timeout=30)

    async def publish(self, tasks: list[Task]) -> None:
        publisher = Publisher(self.bus.js)
        for task in tasks:
            await publisher.publish(task_subject(task.env), task, task.task_id)

    async def scored(self) -> list[ScoredRollout]:
        """Every scored rollout on the bus, in stream order."""
        name = streams.ROLLOUTS_SCORED.name
        info = await self.bus.js.stream_info(name)
        if info.state.messages == 0:
            return []
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await self.bus.js.get_msg(name, seq)
            out.append(wire.decode(ScoredRollout, raw.data or b"", dict(raw.headers or {})))
        return out

    def steps(self) -> list[StepRecord]:
        return read_steps(self.run_dir)

    def step_samples(self) -> list[StepSamples]:
        return read_step_samples(self.run_dir)

    def trained_ids(self) -> set[str]:
        return {sample_id for step in self.step_samples() for sample_id in step.sample_ids}

    def trains_all(self, tasks: list[Task]) -> Callable[[], bool]:
        wanted = {f"{task.task_id}.{i}" for task in tasks for i in range(task.group_size)}
        return lambda: wanted <= self.trained_ids()


@pytest.fixture
async def pipeline(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Pipeline]:
    monkeypatch.setenv("RLPIPE_ENV_CODING_MAX_TOKENS", str(CODING_MAX_TOKENS))
    await provision(bus.js)
    p = Pipeline(bus, tmp_path / "run")
    yield p
    await p.stop_all()


def assert_episode_shape(scored: ScoredRollout) -> None:
    """Opening and everything after it masked (no logprobs, no version); every assistant
    turn with one logprob per token from the worker's policy version."""
    rollout = scored.rollout
    assert rollout.worker_id == "worker-e2e" and rollout.task is not None
    assert rollout.turns[0].role == "user"
    opening = TOKENIZER.decode(rollout.turns[0].token_ids, skip_special=False)
    assert rollout.task.prompt in opening and "<|system|>" in opening
    assistants = [t for t in rollout.turns if t.role == "assistant"]
    num_summaries = rollout.stats[m.EPISODE_STAT_SEGMENTS] - 1
    assert len(assistants) == rollout.stats.get(m.EPISODE_STAT_TURNS, 0) + num_summaries >= 1
    for turn in rollout.turns:
        if turn.role == "assistant":
            assert turn.policy_version is not None and turn.policy_version >= 0
            assert len(turn.logprobs) == len(turn.token_ids) >= 1
            assert all(lp <= 0.0 for lp in turn.logprobs)
        else:
            assert turn.policy_version is None and turn.logprobs == []
    # As the trainer lays it out: loss exactly on the assistant tokens.
    batch = build_batch([scored], [1.0], pad_id=TOKENIZER.pad_id)
    num_generated = sum(len(t.token_ids) for t in assistants)
    assert batch.num_loss_tokens == num_generated


def breakdown(scored: ScoredRollout) -> dict[str, float]:
    return {c.name: c.weight for c in scored.criteria}


async def test_calc_and_coding_episodes_are_rolled_out_rewarded_and_trained(
    pipeline: Pipeline,
) -> None:
    await pipeline.start_all()
    calc = [CalcTasks(difficulty=1, group_size=GROUP, seed=0).task(i) for i in range(2)]
    coding = [CodingTasks(difficulty=1, group_size=GROUP, seed=0).task(i) for i in range(2)]
    await pipeline.publish([*calc, *coding])

    everything = calc + coding
    await wait_for(pipeline.trains_all(everything), TIMEOUT_S, "every rollout trained on")

    scored = {s.rollout.rollout_id: s for s in await pipeline.scored()}
    rubrics = {env: registry.rubric_for(env) for env in ("calc", "coding")}
    for task in everything:
        for index in range(GROUP):
            sample = scored[f"{task.task_id}.{index}"]
            rollout = sample.rollout
            assert rollout.env == task.env and rollout.task == task
            assert sample.scored, sample.unscored_reason
            expected = {c.name: c.weight for c in rubrics[task.env].criteria}
            assert breakdown(sample) == expected
            assert sample.reward == pytest.approx(sum(c.weight * c.score for c in sample.criteria))
            assert_episode_shape(sample)
            if rollout.finish_reason != "stop":
                continue
            # Ended with a final answer: the environment's verdict came back with it.
            if task.env == "calc":
                assert rollout.env_info["expected"] == task.spec["answer"]
                assert isinstance(rollout.env_info["answer_correct"], bool)
            else:
                assert rollout.env_info["task"] == task.spec["task"]
                total = rollout.env_info["tests_total"]
                assert total > 0 and 0 <= rollout.env_info["tests_passed"] <= total
                tests = next(c for c in sample.criteria if c.name == "tests_passed")
                assert tests.score == rollout.env_info["tests_passed"] / total
    assert {s.rollout.finish_reason for s in scored.values() if s.rollout.env == "coding"} & {
        "stop"
    }, "no coding episode was graded"

    # Each step trained on one whole group of one env, at consecutive versions.
    steps = pipeline.steps()
    for step, samples in zip(steps, pipeline.step_samples(), strict=True):
        assert step.num_samples == GROUP and step.num_loss_tokens > 0
        assert len({sample_id.rsplit(".", 1)[0] for sample_id in samples.sample_ids}) == 1
    assert [s.version for s in steps] == list(range(1, len(steps) + 1))
    trained_envs = {scored[i].rollout.env for i in pipeline.trained_ids()}
    assert trained_envs == {"calc", "coding"}


def turn_before(turns: list[m.Turn], turn: m.Turn) -> list[int]:
    index = turns.index(turn)
    return turns[index - 1].token_ids if index else []


class JournalEpisode(Episode):
    """Every turn is an entry; the episode goes on until the harness's max_turns."""

    def __init__(self) -> None:
        self.entries = 0

    async def step(self, action: str, tool_calls: Sequence[m.ToolCall] = ()) -> StepResult:
        self.entries += 1
        return StepResult(observation=f"Entry {self.entries} noted. Write the next one.")


class JournalEnv(Environment):
    name: ClassVar[str] = "journal"

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        opening = Opening(
            messages=(m.ChatMessage(role="user", content=task.prompt),),
            tools=(m.ToolSpec(name="note", description="Adds a note."),),
            max_turns=JOURNAL_TURNS,
            max_tokens=JOURNAL_MAX_TOKENS,
        )
        return JournalEpisode(), opening


def journal_rubric() -> Rubric:
    return Rubric([Criterion("turns", 1.0, turn_penalty(free_turns=2, penalty_per_turn=0.1))])


async def test_a_self_summarizing_episode_is_trained_one_row_per_segment(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Domain(JournalEnv.name, Path(__file__).parent, env=JournalEnv, rubric=journal_rubric)
    monkeypatch.setitem(registry._REGISTERED, JournalEnv.name, journal)
    batches: list[TrainBatch] = []

    def recording_build_batch(*args: object, **kwargs: object) -> TrainBatch:
        batch = build_batch(*args, **kwargs)  # type: ignore[arg-type]
        batches.append(batch)
        return batch

    monkeypatch.setattr(libs.trainer.step, "build_batch", recording_build_batch)
    # The opening is ~350 byte tokens and each turn adds up to ~110: the budget is passed
    # after a few turns, and the restarted context (opening + summary) leaves room again.
    await pipeline.start_all(
        context_budget_tokens=JOURNAL_BUDGET,
        summary_max_tokens=16,
        max_summaries=2,
        max_turns=JOURNAL_TURNS,
    )
    task = Task(
        task_id="journal-1",
        env="journal",
        prompt="Keep a journal: one entry per turn.",
        group_size=GROUP,
    )
    await pipeline.publish([task])
    await wait_for(pipeline.trains_all([task]), TIMEOUT_S, "the summarized group trained on")

    samples = await pipeline.scored()
    assert len(samples) == GROUP
    num_rows = 0
    for sample in samples:
        rollout = sample.rollout
        assert_episode_shape(sample)
        assert rollout.finish_reason == "max_turns"
        assert rollout.stats[m.EPISODE_STAT_TURNS] == JOURNAL_TURNS
        num_segments = int(rollout.stats[m.EPISODE_STAT_SEGMENTS])
        segments = sorted({turn.segment for turn in rollout.turns})
        assert num_segments >= 2 and segments == list(range(num_segments))
        for segment in segments:
            turns = [t for t in rollout.turns if t.segment == segment]
            # Every segment trains: it holds generated turns (entries, and its summary).
            assert any(t.role == "assistant" and t.token_ids for t in turns)
            # Every entry was generated from a context that left room for a whole turn.
            prefix = 0
            for turn in turns:
                is_summary = SUMMARY_REQUEST in TOKENIZER.decode(turn_before(turns, turn))
                if turn.role == "assistant" and not is_summary:
                    assert prefix + JOURNAL_MAX_TOKENS <= JOURNAL_BUDGET
                prefix += len(turn.token_ids)
        first, second = ([t for t in rollout.turns if t.segment == s] for s in (0, 1))
        [summary] = [
            t
            for t in first
            if t.role == "assistant" and SUMMARY_REQUEST in TOKENIZER.decode(turn_before(first, t))
        ]
        request = TOKENIZER.decode(turn_before(first, summary), skip_special=False)
        assert request.endswith(SUMMARY_REQUEST + "<|eos|><|assistant|>")
        assert 1 <= len(summary.token_ids) <= 16
        resumed = TOKENIZER.decode(second[0].token_ids, skip_special=False)
        assert task.prompt in resumed and TOKENIZER.decode(summary.token_ids) in resumed
        assert [c.name for c in sample.criteria] == ["turns"] and sample.scored
        num_rows += num_segments

    [step], [trained] = pipeline.steps(), pipeline.step_samples()  # one group, one step
    assert sorted(trained.sample_ids) == sorted(s.rollout.rollout_id for s in samples)
    [batch] = [b for b in batches if set(b.sample_ids) == set(trained.sample_ids)]
    assert batch.num_rows == num_rows == step.num_rows
    assert step.num_loss_tokens == batch.num_loss_tokens
