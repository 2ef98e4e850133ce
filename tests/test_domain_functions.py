"""The `functions` domain: generated coding tasks, their held-out split, their expert, all
through the coding environment's real sandboxes."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from libs.chat.template import chat_template_for
from libs.domains.coding.grading import grade_files
from libs.domains.functions import FunctionsEnv
from libs.domains.functions.expert import FunctionsExpert
from libs.domains.functions.families import FAMILIES
from libs.domains.functions.tasks import FunctionTasks, generated_task, parse_spec, spec_key
from libs.domains.registry import domain, harness_for
from libs.experts.demos import DemoConfig, record_demonstrations
from libs.experts.record import record_episode
from libs.sandbox import SandboxConfig, build_sandbox_factory
from libs.sft.transcript import transcript_to_json
from libs.tokenizer import load_tokenizer
from libs.trainer.eval_gate import DEFAULT_EVAL_SEED

GRADING = build_sandbox_factory(SandboxConfig())


def one_task_per_family(seed: int = 0) -> dict[str, dict[str, Any]]:
    """The first task of each family among a source's tasks (their specs)."""
    source, index = FunctionTasks(difficulty=0, group_size=1, seed=seed), 0
    found: dict[str, dict[str, Any]] = {}
    while len(found) < len(FAMILIES):
        spec = source.task(index).spec
        found.setdefault(spec["family"], spec)
        index += 1
    return found


def solved(spec: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The function a spec's reference (or the reference of `params`) defines, run here."""
    family, given = parse_spec(spec)  # type: ignore[misc]
    namespace: dict[str, Any] = {}
    exec(family.reference(params or given), namespace)
    return namespace


def test_tasks_are_the_same_in_every_process_and_held_out_tasks_are_never_trained_on() -> None:
    train = FunctionTasks(difficulty=0, group_size=4, seed=0)
    assert train.task(7) == FunctionTasks(difficulty=0, group_size=4, seed=0).task(7)
    trained = {spec_key(train.task(i).spec) for i in range(3000)}
    held_out = FunctionTasks(difficulty=0, group_size=1, seed=DEFAULT_EVAL_SEED)
    demos = FunctionTasks(difficulty=0, group_size=1, seed=DemoConfig().seed)
    assert not trained & {spec_key(held_out.task(i).spec) for i in range(256)}
    assert not trained & {spec_key(demos.task(i).spec) for i in range(256)}
    assert {train.task(i).spec["family"] for i in range(200)} == set(FAMILIES)
    easy = FunctionTasks(difficulty=1, group_size=1, seed=0)
    assert all(FAMILIES[easy.task(i).spec["family"]].difficulty == 1 for i in range(50))


def test_hidden_expectations_are_what_the_reference_returns_and_slips_break_them() -> None:
    source, broken, rng = FunctionTasks(difficulty=0, group_size=1, seed=5), 0, random.Random(0)
    for index in range(200):
        spec = source.task(index).spec
        task = generated_task(spec)
        assert task is not None
        family, params = parse_spec(spec)  # type: ignore[misc]
        for case in task.cases:
            assert eval(case.code, solved(spec)) == case.expected, (spec, case)
        slipped = solved(spec, family.slipped(params, rng))
        broken += any(eval(case.code, slipped) != case.expected for case in task.cases)
    assert broken >= 180  # a slip that happens to pass every case is simply a right answer


async def test_every_family_reference_passes_in_the_sandbox_and_every_stub_fails(
    tmp_path: Path,
) -> None:
    for family, spec in one_task_per_family().items():
        task = generated_task(spec)
        assert task is not None and task.prompt.startswith("Implement `")
        final = tmp_path / family
        shutil.copytree(task.files_dir, final)
        shutil.copytree(task.reference_dir, final, dirs_exist_ok=True)
        grade = await grade_files(task, final, GRADING)
        assert grade.info()["answer_correct"] and grade.tests_total == 6, (family, grade)
        start = await grade_files(task, task.files_dir, GRADING)
        assert start.tests_passed == 0 and not start.info()["answer_correct"], family


@pytest.mark.parametrize(
    "params",
    [
        {"fn": "os.system('x')", "arg": "x", "a": 2, "b": 3},  # not a family's name
        {"fn": "scale", "arg": "x):\n import os\n#", "a": 2, "b": 3},  # not a family's arg
        {"fn": "scale", "arg": "x", "a": "2", "b": 3},  # another type
        {"fn": "scale", "arg": "x", "a": 2},  # a constant missing
        {"fn": "scale", "arg": "x", "a": 2, "b": 3, "c": 4},  # one too many
        {"fn": "scale", "arg": "x", "a": 2, "b": 10**12},  # far past what families draw
    ],
)
async def test_a_spec_no_family_drew_is_refused(params: dict[str, Any]) -> None:
    spec = {"family": "affine", "params": params}
    assert parse_spec(spec) is None and generated_task(spec) is None
    bad = msgspec.structs.replace(FunctionTasks(difficulty=0, group_size=1, seed=0).task(0))
    with pytest.raises(ValueError, match="its spec names no task"):
        await FunctionsEnv().reset(msgspec.structs.replace(bad, spec=spec))


async def test_the_expert_plays_the_reference_through_the_tools_and_slips_fail() -> None:
    env, template = FunctionsEnv(), chat_template_for(load_tokenizer("byte"))
    agent = harness_for("functions", template)
    task = FunctionTasks(difficulty=2, group_size=1, seed=0).task(0)
    rng = random.Random(0)
    transcripts, info = await record_episode(env, task, FunctionsExpert(0.0), agent, template, rng)
    assert info["answer_correct"] and info["tests_passed"] == info["tests_total"] == 6
    calls = [call.name for message in transcripts[0].messages for call in message.tool_calls]
    assert calls == ["read_file", "write_file", "run_tests"]
    tool_replies = [m.content for m in transcripts[0].messages if m.role == "tool"]
    assert "raise NotImplementedError" in tool_replies[0] and "2 passed" in tool_replies[2]
    assert domain("functions").expert is FunctionsExpert


async def test_the_expert_fixes_some_of_its_slips_after_the_visible_tests_fail() -> None:
    env, template = FunctionsEnv(), chat_template_for(load_tokenizer("byte"))
    agent = harness_for("functions", template)
    task = FunctionTasks(difficulty=2, group_size=1, seed=0).task(0)
    seen: dict[bool, list[str]] = {}
    for seed in range(12):  # every episode slips; RECOVERY_RATE of them are fixed
        episode, info = await record_episode(
            env, task, FunctionsExpert(1.0), agent, template, random.Random(seed)
        )
        calls = [call.name for message in episode[0].messages for call in message.tool_calls]
        seen.setdefault(bool(info["answer_correct"]), calls)
        if not info["answer_correct"]:
            assert info["tests_passed"] < info["tests_total"]
    assert seen[False] == ["read_file", "write_file", "run_tests"]  # answered anyway
    assert seen[True] == ["read_file", "write_file", "run_tests", "write_file", "run_tests"]


async def test_demonstrations_are_the_same_however_many_episodes_run_at_once() -> None:
    config = DemoConfig(env="functions", num_tasks=6, error_rate=0.5)

    async def recorded(concurrency: int) -> list[Any]:
        episodes = record_demonstrations(config, concurrency=concurrency)
        return [[transcript_to_json(t) for t in ts] async for ts, _ in episodes]

    assert await recorded(1) == await recorded(4)
