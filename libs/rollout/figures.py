"""What a set of scored episodes shows: task success, reward, tool use, turns, summaries.

    figures = episode_figures(scored_rollouts)
    # {"episodes": 16, "success": 0.62, "reward": 0.71, "tool_call_validity": 0.98,
    #  "episodes_with_tool_calls": 0.94, "tool_calls_per_episode": 1.1,
    #  "turns_per_episode": 2.1, "segments_per_episode": 1.0}

Success is the environment's verdict (env_info `answer_correct`); tool-call validity is
well-formed calls over all calls attempted (None when none was attempted).

    group_figures(scored)    # {"tasks": 128, "always": 46, "never": 34, "mixed": 48}
    family_figures(scored)   # {"affine": {"tasks": 16, "success": 0.19}, ...}

Over several samples of each task, a task sometimes solved gives GRPO a success signal; one
always or never solved gives it only what partial credit its rewards vary by (a group of
equal rewards has advantage 0): `group_figures` counts the tasks solved always, never and
sometimes. `family_figures` splits success by the task spec's `family` (generated domains
such as `functions`), so a family the policy never solves shows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from proto import messages as m


def episode_figures(scored: Sequence[m.ScoredRollout]) -> dict[str, Any]:
    """success, reward, tool-call validity, calls/turns/segments per episode of `scored`."""
    n = max(len(scored), 1)

    def total(key: str) -> float:
        return sum(s.rollout.stats.get(key, 0.0) for s in scored)

    valid, invalid = total(m.EPISODE_STAT_TOOL_CALLS), total(m.EPISODE_STAT_INVALID_TOOL_CALLS)
    with_calls = sum(s.rollout.stats.get(m.EPISODE_STAT_TOOL_CALLS, 0.0) > 0 for s in scored)
    return {
        "episodes": len(scored),
        "success": round(sum(is_success(s) for s in scored) / n, 3),
        "reward": round(sum(s.reward for s in scored) / n, 3),
        "tool_call_validity": round(valid / (valid + invalid), 3) if valid + invalid else None,
        "episodes_with_tool_calls": round(with_calls / n, 3),
        "tool_calls_per_episode": round(valid / n, 3),
        "turns_per_episode": round(total(m.EPISODE_STAT_TURNS) / n, 3),
        "segments_per_episode": round(total(m.EPISODE_STAT_SEGMENTS) / n, 3),
    }


def is_success(scored: m.ScoredRollout) -> bool:
    """The task was solved: the environment said the answer is right."""
    return bool(scored.rollout.env_info.get("answer_correct"))


def group_figures(scored: Sequence[m.ScoredRollout]) -> dict[str, int]:
    """Tasks (by task id) whose samples were all solved, none, or some."""
    wins: dict[str, list[bool]] = defaultdict(list)
    for sample in scored:
        wins[sample.rollout.task_id].append(is_success(sample))
    always = sum(all(found) for found in wins.values())
    never = sum(not any(found) for found in wins.values())
    mixed = len(wins) - always - never
    return {"tasks": len(wins), "always": always, "never": never, "mixed": mixed}


def family_figures(scored: Sequence[m.ScoredRollout]) -> dict[str, dict[str, Any]]:
    """Success per task family (the spec's `family`), for tasks that name one; {} if none."""
    by_family: dict[str, list[m.ScoredRollout]] = defaultdict(list)
    for sample in scored:
        task = sample.rollout.task
        family = task.spec.get("family") if task is not None else None
        if isinstance(family, str):
            by_family[family].append(sample)
    return {
        family: {
            "tasks": len({s.rollout.task_id for s in samples}),
            "success": round(sum(is_success(s) for s in samples) / len(samples), 3),
        }
        for family, samples in sorted(by_family.items())
    }
