"""The SFT stage: transcripts render as the harness lays out episodes, bad lines are named,
experts demonstrate through the real environments, training is resumable."""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch

from apps import sft_cli
from apps.cli import build_parser
from apps.launcher import warm_start
from apps.launcher.episode_report import first_last_report
from apps.launcher.recipe import WarmStartRecipe, load_recipe
from apps.sft_cli import LogFn
from libs.chat.template import ChatTemplate, chat_template_for, save_tokenizer
from libs.domains.recall.expert import RecallEpisodeExpert, RecallExpert
from libs.domains.registry import domain, harness_for, make_env
from libs.engine.base import Completion, SamplingParams
from libs.envs.latency import ToolLatency, parse_tool_latency, with_tool_latency
from libs.envs.local_client import LocalEnvClient
from libs.experts.demos import DemoConfig, demonstrations_digest, write_demonstrations
from libs.experts.record import record_episode
from libs.policy import PolicyConfig, build_policy, load_policy
from libs.rollout.agent import AgentRunner
from libs.rollout.episode import RunnerSettings
from libs.sft.loss import MIN_SHARED_PREFIX_TOKENS, sft_loss, shared_prefix_length
from libs.sft.train import SftConfig, SftStep, load_examples, train_sft, training_policy
from libs.sft.transcript import (
    Transcript,
    TranscriptError,
    parse_line,
    read_transcripts,
    render_transcript,
    transcript_texts,
    transcript_to_json,
    without_system_message,
)
from libs.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    train_chat_tokenizer,
)
from proto import messages as m
from proto.messages import Rollout

TOKENIZER = ByteTokenizer()
TEMPLATE = chat_template_for(TOKENIZER)


async def _expert_episode(env: str, index: int, error_rate: float = 0.0) -> list[Transcript]:
    environment = make_env(env)
    task = environment.task_source(difficulty=0, group_size=1, seed=5).task(index)
    make_expert = domain(env).expert
    assert make_expert is not None
    expert = make_expert(error_rate)
    transcripts, _ = await record_episode(
        environment, task, expert, harness_for(env, TEMPLATE), TEMPLATE, random.Random(0)
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
        harness_for(env, TEMPLATE),
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


@pytest.mark.parametrize("tokenizer", ["byte", "trained"])
async def test_recall_needs_its_summaries(tokenizer: str) -> None:
    # The budget is counted in the policy's tokens: with the byte tokenizer and with one
    # trained on recall's demonstrations (a reveal 142 tokens against 30), a segment holds
    # three reveals, so a 6-digit code needs a summary either way.
    template = TEMPLATE if tokenizer == "byte" else await _trained_template("recall")
    env = make_env("recall")
    task = env.task_source(difficulty=0, group_size=1, seed=1).task(0)
    settings = harness_for("recall", template)
    for summarize, solved in ((True, True), (False, False)):
        agent = settings.model_copy(update={"summarize": summarize})
        transcripts, info = await record_episode(
            env, task, RecallExpert(), agent, template, random.Random(0)
        )
        assert bool(info.get("answer_correct")) is solved
        assert len(transcripts) == (2 if summarize else 1)


async def _trained_template(env: str) -> ChatTemplate:
    """The chat template of a tokenizer trained on a few of `env`'s demonstrations."""
    transcripts = [t for i in range(8) for t in await _expert_episode(env, i)]
    texts = [text for t in transcripts for text in transcript_texts(t)]
    return chat_template_for(train_chat_tokenizer(texts, vocab_size=400))


async def test_every_digit_the_recall_expert_writes_is_just_revealed_or_its_last_note() -> None:
    # What the warm start must learn to copy: no look-up of one `digit k of 6` result among
    # several (without the notes, the last digit was never learnt).
    notes, revealed = [], ""
    for transcript in await _expert_episode("recall", 2):
        for message in transcript.messages:
            if message.role == "tool":
                revealed = message.content.rsplit(": ", 1)[1]
            elif message.role == "assistant" and message.content.isdigit():
                last = notes[-1] if notes else ""
                assert message.content in (last, last + revealed), (notes, message.content)
                notes.append(message.content)
    assert len(notes) >= 6 and len(notes[-1]) == 6


def domain_warm_start(env: str) -> WarmStartRecipe:
    """The `[warm_start]` of domain `env`'s recipe file."""
    recipe = load_recipe(domain(env).recipe_path).warm_start
    assert recipe is not None, f"{env}'s recipe has a warm start"
    return recipe


def test_recall_rl_decays_its_rate_more_slowly_and_both_keep_the_anchor() -> None:
    recall, calc = (
        domain_warm_start("recall").rl["trainer"],
        domain_warm_start("calc").rl["trainer"],
    )
    assert recall["kl_coef"] == calc["kl_coef"] == 0.2
    assert recall["learning_rate"] == calc["learning_rate"]
    assert recall["learning_rate_decay_steps"] == 1000
    assert "learning_rate_decay_steps" not in calc, "calc: the trainer's 400"


def test_rl_from_a_warm_start_starts_the_trainer_and_the_workers_from_it() -> None:
    tables = warm_start.policy_tables(Path("model"))
    assert tables["trainer"]["policy"] == tables["rollout_worker"]["policy"] == {"path": "model"}


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


def test_the_shared_prefix_loss_is_the_plain_forward_loss(tmp_path: Path) -> None:
    data = tmp_path / "demos.jsonl"
    asyncio.run(write_demonstrations(DemoConfig(env="calc", num_tasks=4), data))
    config = SftConfig(data=data, out=tmp_path / "out")
    examples = load_examples(config, TOKENIZER)
    assert shared_prefix_length(examples) > 500, "calc transcripts share their opening"
    model = build_policy(PolicyConfig(device="cpu"))
    losses, grads = [], []
    for prefix_floor in (MIN_SHARED_PREFIX_TOKENS, 10**9):  # shared prefix, then plain forward
        model.zero_grad()
        with patch("libs.sft.loss.MIN_SHARED_PREFIX_TOKENS", prefix_floor):
            loss, _ = sft_loss(model, examples, TOKENIZER.pad_id)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


async def test_slow_tools_delay_the_step_not_the_answer() -> None:
    env = with_tool_latency(make_env("calc"), parse_tool_latency("constant:seconds=0.2"))
    task = env.task_source(difficulty=0, group_size=1, seed=0).task(0)
    episode, _ = await env.reset(task)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await episode.step("", [m.ToolCall(call_id="c-0", name="add", arguments={"a": 1, "b": 2})])
    assert loop.time() - started >= 0.2
    # Tools an hour slow: an answer that waited for their latency would never come back.
    slow = with_tool_latency(make_env("calc"), parse_tool_latency("constant:seconds=3600"))
    episode, _ = await slow.reset(task)
    result = await asyncio.wait_for(episode.step("3"), timeout=60)
    assert result.done


def test_the_demo_report_compares_the_first_and_last_steps() -> None:
    def scored(rollout_id: str, correct: bool, calls: int) -> m.ScoredRollout:
        rollout = Rollout(
            rollout_id=rollout_id,
            task_id="t",
            group_id="t",
            sample_index=0,
            env="calc",
            turns=[],
            finish_reason="stop",
            worker_id="w",
            env_info={"answer_correct": correct},
            stats={m.EPISODE_STAT_TOOL_CALLS: calls, m.EPISODE_STAT_TURNS: calls + 1},
        )
        return m.ScoredRollout(rollout=rollout, reward=float(correct))

    steps = [["a", "b"], ["c", "d"], ["e", "f"]]
    samples = [scored("a", False, 0), scored("b", False, 1), scored("c", True, 1)]
    samples += [scored("d", False, 1), scored("e", True, 1), scored("f", True, 2)]
    report = first_last_report(steps, samples, window=1)
    assert report["episodes_first_steps"]["success"] == 0.0
    assert report["episodes_last_steps"]["success"] == 1.0
    assert report["episodes_first_steps"]["episodes_with_tool_calls"] == 0.5
    assert report["episodes_last_steps"]["turns_per_episode"] == 2.5


def test_the_short_context_stage_drops_only_the_system_message() -> None:
    (transcript,) = asyncio.run(_expert_episode("calc", 2))
    full, full_mask = render_transcript(transcript, TEMPLATE)
    short, short_mask = render_transcript(without_system_message(transcript), TEMPLATE)
    assert len(short) < len(full) // 2, "the opening is most of a calc transcript"
    trained = [i for i, keep in zip(full, full_mask, strict=True) if keep]
    assert [i for i, keep in zip(short, short_mask, strict=True) if keep] == trained


def test_the_warm_start_cache_follows_what_the_demonstrations_are(tmp_path: Path) -> None:
    # A recall expert that summarizes differently records other demonstrations under the
    # same recipe settings: its cached warm start must not be reused.
    recipe = domain_warm_start("recall")
    before = warm_start.warm_start_dir("recall", tmp_path, recipe)
    demonstrations_digest.cache_clear()
    assert warm_start.warm_start_dir("recall", tmp_path, recipe) == before, "stable"
    terse = patch.object(RecallEpisodeExpert, "summary", lambda self: f"Read: {self.digits}")
    with terse:
        demonstrations_digest.cache_clear()
        changed = warm_start.warm_start_dir("recall", tmp_path, recipe)
    demonstrations_digest.cache_clear()
    assert changed != before


def test_the_warm_start_cache_follows_the_recipes_build_settings(tmp_path: Path) -> None:
    recipe = tiny_recipe()
    folder = warm_start.warm_start_dir("calc", tmp_path, recipe)
    changes = ({"steps": 3}, {"num_tasks": 5}, {"error_rate": 0.1}, {"batch_size": 4})
    for changed in (*changes, {"preset": "agent-75m"}):
        assert warm_start.warm_start_dir("calc", tmp_path, tiny_recipe(**changed)) != folder
    rl = {"trainer": {"learning_rate": 1e-5}}
    assert warm_start.warm_start_dir("calc", tmp_path, tiny_recipe(rl=rl)) == folder, (
        "RL's settings do not change what the warm start is"
    )


def test_a_warm_start_fine_tunes_its_recipes_preset_with_fp32_weights(tmp_path: Path) -> None:
    agent = warm_start.sft_stage("calc", tmp_path, tiny_recipe(preset="agent-75m")).policy
    assert agent.preset == "agent-75m" and agent.tokenizer is not None
    assert warm_start.sft_stage("calc", tmp_path, tiny_recipe()).policy.preset == "tiny"
    # bf16 weights would not take the SFT's updates: the optimizer steps fp32 ones on any
    # device (a GPU runs the forward in bf16), unless a dtype is asked for.
    assert training_policy(agent, TOKENIZER).dtype == "float32"
    assert training_policy(agent.model_copy(update={"dtype": "bfloat16"}), TOKENIZER).dtype == (
        "bfloat16"
    )


def tiny_recipe(**changes: Any) -> WarmStartRecipe:
    """A calc warm start of 4 demonstrations and 2 SFT steps, with `changes`."""
    fields = {"num_tasks": 4, "error_rate": 0.0, "steps": 2, "tokenizer_vocab_size": 400}
    return WarmStartRecipe.model_validate({**fields, "batch_size": 2, **changes})


def test_a_warm_start_trains_on_the_free_cores_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe = tiny_recipe()
    threads_during: list[int] = []
    real_run_with_progress = warm_start.run_with_progress
    progress: list[tuple[str, dict[str, Any]]] = []

    def train(config: SftConfig, title: str, emit: LogFn | None) -> dict[str, Any]:
        threads_during.append(torch.get_num_threads())
        return real_run_with_progress(config, title, emit)

    def emit(event: str, **fields: Any) -> None:  # the demo passes its launcher's log
        progress.append((event, fields))

    # Nothing else runs while a demo builds its warm start: two threads where there are two
    # cores, whatever the process had (here 3); OMP_NUM_THREADS decides when set.
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(3)
    with patch.object(warm_start, "run_with_progress", train):
        model = warm_start.ensure_warm_start("calc", tmp_path, recipe, emit=emit)
        assert (model / "model.safetensors").exists()
        assert threads_during == [min(2, cores)], "the SFT on the free cores"
        assert torch.get_num_threads() == 3, "restored after"
        assert warm_start.ensure_warm_start("calc", tmp_path, recipe, emit=emit) == model
    assert len(threads_during) == 1, "the cached warm start is reused, not trained again"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert warm_start.warm_start_threads() == 1
    # Not a terminal here: the progress came as lines through `emit`.
    events = [(event, fields["step"]) for event, fields in progress]
    assert events == [("warm start (calc): sft step", 2)]
    assert progress[0][1]["steps_per_s"] > 0, "the line says how fast the SFT steps"


def test_a_chat_tokenizer_trained_on_demonstrations_keeps_digits_apart(tmp_path: Path) -> None:
    transcripts = [t for i in range(40) for t in asyncio.run(_expert_episode("calc", i))]
    texts = [text for t in transcripts for text in transcript_texts(t)]
    tokenizer = train_chat_tokenizer(texts, vocab_size=400)
    assert tokenizer.vocab_size <= 400
    template = chat_template_for(tokenizer)
    ids, mask = render_transcript(transcripts[0], template)
    byte_ids, _ = render_transcript(transcripts[0], TEMPLATE)
    assert len(ids) < len(byte_ids) / 3, "recurring text (the opening) merged into few tokens"
    assert all(tokenizer.decode(tokenizer.encode(text)) == text for text in texts), "lossless"
    # Numbers are written digit by digit, wherever they stand.
    for text in ("1264", '{"a": 1264, "b": 7}', "-31"):
        digits = [
            tokenizer.decode([i]) for i in tokenizer.encode(text) if tokenizer.decode([i]).isdigit()
        ]
        assert digits == [c for c in text if c.isdigit()]
    # Saved beside a model, it is the folder's own tokenizer, ChatML template included.
    save_tokenizer(tokenizer, tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, HFTokenizer)
    assert render_transcript(transcripts[0], chat_template_for(loaded)) == (ids, mask)


def test_a_chat_tokenizer_needs_room_for_the_bytes_and_specials() -> None:
    with pytest.raises(ValueError, match="vocab_size must hold the 256 bytes"):
        train_chat_tokenizer(["hello"], vocab_size=258)


def test_a_warm_start_with_its_own_tokenizer_is_a_model_folder_carrying_it(
    tmp_path: Path,
) -> None:
    recipe = tiny_recipe()
    model_dir = warm_start.ensure_warm_start("calc", tmp_path, recipe)
    tokenizer = load_tokenizer(str(model_dir))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size <= 400
    trained = load_tokenizer(str(model_dir.parent / warm_start.TOKENIZER_DIR))
    assert tokenizer.encode("What is 12 * 7?") == trained.encode("What is 12 * 7?")
    model = load_policy(model_dir)
    assert model.config.vocab_size == tokenizer.vocab_size


def test_rlpipe_sft_trains_a_tokenizer_of_its_own_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demos, out = tmp_path / "demos.jsonl", tmp_path / "calc-sft"
    asyncio.run(write_demonstrations(DemoConfig(env="calc", num_tasks=8), demos))
    flags = ["sft", "--data", str(demos), "--out", str(out), "--train-tokenizer", "400"]
    with_base = build_parser().parse_args([*flags, "--policy-path", str(tmp_path)])
    assert sft_cli.run(with_base) == 2
    assert "--train-tokenizer builds a new policy" in capsys.readouterr().err
    args = build_parser().parse_args([*flags, "--steps", "2", "--batch-size", "2"])
    assert sft_cli.run(args) == 0
    tokenizer = load_tokenizer(str(out))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size <= 400
    assert load_policy(out).config.vocab_size == tokenizer.vocab_size
