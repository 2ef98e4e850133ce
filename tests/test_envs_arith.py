"""The built-in arithmetic task: deterministic, correct, and as short as a from-scratch
byte-level policy needs."""

from __future__ import annotations

import re

import pytest

from libs.domains.arith.env import ArithmeticEnv, ArithmeticTasks, leading_digits
from libs.domains.registry import UnknownDomainError, domain_names, make_env


def test_same_seed_gives_the_same_tasks_in_any_order() -> None:
    a = ArithmeticTasks(difficulty=2, group_size=8, seed=7)
    b = ArithmeticTasks(difficulty=2, group_size=8, seed=7)
    forward = [a.task(i) for i in range(50)]
    backward = [b.task(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    other_seed = [ArithmeticTasks(difficulty=2, group_size=8, seed=8).task(i) for i in range(50)]
    assert [t.prompt for t in forward] != [t.prompt for t in other_seed]


def test_task_ids_are_unique_across_indices_seeds_and_difficulties() -> None:
    ids = {
        ArithmeticTasks(difficulty=d, group_size=1, seed=s).task(i).task_id
        for d in (0, 1, 3)
        for s in (0, 1)
        for i in range(100)
    }
    assert len(ids) == 3 * 2 * 100


def test_difficulty_zero_is_copying_one_digit() -> None:
    source = ArithmeticTasks(difficulty=0, group_size=4, seed=0)
    tasks = [source.task(i) for i in range(200)]
    for task in tasks:
        assert re.fullmatch(r"[0-9]=", task.prompt)
        assert task.spec == {"answer": task.prompt[0], "difficulty": 0, "max_tokens": 2}
        assert task.env == "arith" and task.group_size == 4 and task.min_policy_version == 0
    assert {t.spec["answer"] for t in tasks} == set("0123456789")


@pytest.mark.parametrize("difficulty", [1, 2, 5])
def test_addition_answers_are_correct_with_d_digit_operands(difficulty: int) -> None:
    source = ArithmeticTasks(difficulty=difficulty, group_size=8, seed=3)
    for index in range(200):
        task = source.task(index)
        match = re.fullmatch(r"([0-9]+)\+([0-9]+)=", task.prompt)
        assert match, task.prompt
        a, b = match.groups()
        assert int(task.spec["answer"]) == int(a) + int(b)
        assert task.spec["max_tokens"] == len(task.spec["answer"]) + 1
        assert task.spec["difficulty"] == difficulty
        if difficulty > 1:
            assert len(a) == len(b) == difficulty
        else:
            assert len(a) == len(b) == 1


def test_bad_knobs_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticTasks(difficulty=-1, group_size=1, seed=0)
    with pytest.raises(ValueError, match="group_size"):
        ArithmeticTasks(difficulty=0, group_size=0, seed=0)


def test_leading_digits_cuts_at_the_first_non_digit() -> None:
    assert leading_digits("42x7") == "42"
    assert leading_digits("x42") == ""
    assert leading_digits("") == ""
    assert leading_digits("٣") == ""  # a non-ASCII digit is not an answer digit


async def test_an_episode_opens_on_the_prompt_and_ends_after_one_answer() -> None:
    task = ArithmeticTasks(difficulty=1, group_size=1, seed=0).task(0)
    episode, opening = await ArithmeticEnv().reset(task)
    assert opening.observation == task.prompt
    assert opening.max_tokens == len(task.spec["answer"]) + 1
    right = await episode.step(task.spec["answer"] + "junk")
    wrong = await episode.step("x")
    expected = task.spec["answer"]
    assert right.done and right.info == {"answer_correct": True, "expected": expected}
    assert wrong.done and wrong.info == {"answer_correct": False, "expected": expected}


def test_registry_knows_arith_and_names_the_known_ones_otherwise() -> None:
    assert "arith" in domain_names()
    assert isinstance(make_env("arith"), ArithmeticEnv)
    with pytest.raises(UnknownDomainError, match=r"known: .*arith"):
        make_env("chess")
