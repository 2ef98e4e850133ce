"""The SFT stage: transcripts render as the harness lays out episodes, bad lines are named,
experts demonstrate through the real environments, training is resumable."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from libs.chat.template import chat_template_for
from libs.engine.base import Completion, SamplingParams
from libs.envs import make_env
from libs.envs.latency import ToolLatency, parse_tool_latency, with_tool_latency
from libs.envs.local_client import LocalEnvClient
from libs.experts.demos import EXPERTS, DemoConfig, harness_settings, write_demonstrations
from libs.experts.recall import RecallExpert
from libs.experts.record import record_episode
from libs.policy import load_policy
from libs.rollout.agent import AgentRunner
from libs.rollout.episode import RunnerSettings
from libs.sft.train import SftConfig, SftStep, train_sft
from libs.sft.transcript import (
    Transcript,
    TranscriptError,
    parse_line,
    read_transcripts,
    render_transcript,
    transcript_to_json,
)
from libs.tokenizer import ByteTokenizer
from proto.messages import Rollout

TOKENIZER = ByteTokenizer()
TEMPLATE = chat_template_for(TOKENIZER)


async def _expert_episode(env: str, index: int, error_rate: float = 0.0) -> list[Transcript]:
    environment = make_env(env)
    task = environment.task_source(difficulty=0, group_size=1, seed=5).task(index)
    expert = EXPERTS[env](error_rate)
    transcripts, _ = await record_episode(
        environment, task, expert, harness_settings(env), TEMPLATE, random.Random(0)
    )
    return transcripts


async def _harness_replay(env: str, index: int, texts: list[str]) -> Rollout:
    """The same task run by the real harness with an engine that writes `texts` in order."""
    environment = make_env(env)
    task = environment.task_source(difficulty=0, group_size=1, seed=5).task(index)
    queue = list(texts)

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        ids = [*TOKENIZER.encode(queue.pop(0)), TOKENIZER.eos_id]
        return [Completion(0, 0, ids, [0.0] * len(ids), [0.0] * len(ids), "stop", 0)]

    runner = AgentRunner(
        LocalEnvClient({env: environment}),
        TOKENIZER,
        generate,
        RunnerSettings(worker_id="test"),
        harness_settings(env),
    )
    (rollout,) = await runner.run(task)
    return rollout


@pytest.mark.parametrize("env", ["calc", "recall"])
async def test_demonstrations_are_token_for_token_what_the_harness_trains_on(env: str) -> None:
    transcripts = await _expert_episode(env, index=3)
    texts = [
        TOKENIZER.decode(ids[start:end])
        for t in transcripts
        for ids, mask in [render_transcript(t, TEMPLATE)]
        for start, end in _spans(mask)
    ]
    rollout = await _harness_replay(env, 3, texts)
    assert rollout.env_info["answer_correct"]
    for segment, transcript in enumerate(transcripts):
        ids, mask = render_transcript(transcript, TEMPLATE)
        turns = [t for t in rollout.turns if t.segment == segment]
        assert ids == [i for t in turns for i in t.token_ids]
        trained = [i for t in turns if t.role == "assistant" for i in t.token_ids]
        assert [i for i, keep in zip(ids, mask, strict=True) if keep] == trained
    if env == "recall":
        assert len(transcripts) >= 2, "a recall episode outgrows one context segment"


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, keep in enumerate([*mask, 0]):
        if keep and start is None:
            start = i
        if not keep and start is not None:
            spans.append((start, i - 1))  # the stop token is not part of the text
            start = None
    return spans


async def test_recall_needs_its_summaries() -> None:
    env = make_env("recall")
    task = env.task_source(difficulty=0, group_size=1, seed=1).task(0)
    settings = harness_settings("recall")
    for summarize, solved in ((True, True), (False, False)):
        agent = replace(settings, summarize=summarize)
        _, info = await record_episode(env, task, RecallExpert(), agent, TEMPLATE, random.Random(0))
        assert bool(info.get("answer_correct")) is solved


async def test_the_error_rate_knob_makes_experts_fail_that_often(tmp_path: Path) -> None:
    perfect = await write_demonstrations(
        DemoConfig(env="calc", num_tasks=60, error_rate=0.0), tmp_path / "a"
    )
    sloppy = await write_demonstrations(
        DemoConfig(env="calc", num_tasks=60, error_rate=0.5), tmp_path / "b"
    )
    assert perfect.success_rate == 1.0
    assert 0.3 <= sloppy.success_rate <= 0.7
    lines = read_transcripts(tmp_path / "a")
    assert len(lines) == 60 and all(t.tools for t in lines)


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ("{not json", "line 2: (line): not valid JSON"),
        ('{"messages": []}', "line 2: messages: must be a non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role: must be one of"),
        ('{"messages": [{"role": "assistant"}]}', "messages[0].content: is missing"),
        (
            '{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "add", '
            '"arguments": [1]}]}]}',
            "messages[0].tool_calls[0].arguments: must be a JSON object",
        ),
        (
            '{"messages": [{"role": "tool", "content": "3"}]}',
            "messages[0].tool_call_id: is missing",
        ),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ],
)
def test_a_malformed_line_is_named_by_number_and_field(
    tmp_path: Path, line: str, where: str
) -> None:
    good = json.dumps({"messages": [{"role": "assistant", "content": "ok"}]})
    path = tmp_path / "demos.jsonl"
    path.write_text(f"{good}\n{line}\n")
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert where in str(caught.value)
    assert caught.value.line == 2


def test_transcripts_round_trip_through_jsonl() -> None:
    transcripts = asyncio.run(_expert_episode("recall", 1))
    for transcript in transcripts:
        again = parse_line(json.dumps(transcript_to_json(transcript)), "x", 1)
        assert render_transcript(again, TEMPLATE) == render_transcript(transcript, TEMPLATE)


def test_sft_resumes_where_it_stopped_and_ends_where_an_uninterrupted_run_ends(
    tmp_path: Path,
) -> None:
    data = tmp_path / "demos.jsonl"
    asyncio.run(write_demonstrations(DemoConfig(env="calc", num_tasks=8), data))
    base = SftConfig(
        data=data, out=tmp_path / "full", steps=6, batch_size=2, checkpoint_every_steps=3
    )
    full = train_sft(base)
    # An interrupted run: 3 steps checkpointed, then the process "dies" (we stop calling).
    resumed_config = replace(base, out=tmp_path / "resumed")
    seen: list[int] = []

    def crash_after_checkpoint(step: SftStep) -> None:
        if step.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sft(resumed_config, crash_after_checkpoint)
    resumed = train_sft(resumed_config, lambda step: seen.append(step.step))
    assert seen == [4, 5, 6], "the rerun continued from the step-3 checkpoint"
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], abs=1e-4)
    a, b = load_policy(tmp_path / "full"), load_policy(tmp_path / "resumed")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.allclose(x, y, atol=1e-5), name
    assert train_sft(resumed_config) == resumed, "a finished run is not trained again"


def test_tool_latency_is_heavy_tailed_and_configurable() -> None:
    latency = parse_tool_latency("lognormal:median_s=0.1,sigma=1.2,max_s=5")
    rng = random.Random(0)
    draws = sorted(latency.draw(rng) for _ in range(4000))
    median, p99 = draws[len(draws) // 2], draws[int(len(draws) * 0.99)]
    assert 0.08 < median < 0.12 and p99 > 8 * median and draws[-1] <= 5
    assert parse_tool_latency("none") == ToolLatency()
    with pytest.raises(ValueError, match="sigma must be a number"):
        parse_tool_latency("lognormal:sigma=wide")
    env = make_env("calc")
    assert with_tool_latency(env, ToolLatency()) is env
