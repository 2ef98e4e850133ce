"""Held-out figures over several samples a task: the tasks solved always, never and
sometimes (GRPO's signal), and success per task family, from `rlpipe domain evaluate`'s
evaluator on a real environment."""

from __future__ import annotations

import pytest

from libs.engine.hf import HFEngine
from libs.policy import PolicyConfig, build_policy
from libs.rollout.figures import family_figures, group_figures
from libs.sft.evaluate import measure
from libs.tokenizer import ByteTokenizer
from proto.messages import Rollout, ScoredRollout, Task, Turn


def sample(task: str, index: int, solved: bool, family: str | None) -> ScoredRollout:
    spec = {"family": family} if family else {}
    rollout = Rollout(
        rollout_id=f"{task}.{index}",
        task_id=task,
        group_id=task,
        sample_index=index,
        env="functions",
        turns=[Turn(role="user", token_ids=[1])],
        finish_reason="stop",
        task=Task(task_id=task, env="functions", prompt="", spec=spec),
        env_info={"answer_correct": solved},
    )
    return ScoredRollout(rollout=rollout, reward=float(solved))


def test_tasks_are_counted_by_how_often_their_samples_solve_them() -> None:
    outcomes = {"t0": [True, True], "t1": [False, False], "t2": [True, False], "t3": [False, True]}
    families = {"t0": "affine", "t1": "affine", "t2": "clamp", "t3": None}
    scored = [
        sample(task, i, solved, families[task])
        for task, solved_each in outcomes.items()
        for i, solved in enumerate(solved_each)
    ]
    assert group_figures(scored) == {"tasks": 4, "always": 1, "never": 1, "mixed": 2}
    assert family_figures(scored) == {
        "affine": {"tasks": 2, "success": 0.5},
        "clamp": {"tasks": 1, "success": 0.5},
    }
    assert family_figures([sample("t", 0, True, None)]) == {}


@pytest.mark.parametrize("group_size", [1, 2])
async def test_evaluate_reports_groups_and_families_of_generated_tasks(group_size: int) -> None:
    """A random-init policy on `functions` (sandboxed): it never calls a tool, so every task
    is never solved; each task names its family."""
    tokenizer = ByteTokenizer()
    engine = HFEngine(build_policy(PolicyConfig(preset="tiny", seed=3, device="cpu")), tokenizer)
    figures = await measure(engine, tokenizer, "functions", num_tasks=3, group_size=group_size)
    assert figures["episodes"] == 3 * group_size and figures["success"] == 0.0
    families = figures["families"]
    assert sum(f["tasks"] for f in families.values()) == 3
    assert all(f["success"] == 0.0 for f in families.values())
    if group_size == 1:
        assert "groups" not in figures
    else:
        assert figures["groups"] == {"tasks": 3, "always": 0, "never": 3, "mixed": 0}
