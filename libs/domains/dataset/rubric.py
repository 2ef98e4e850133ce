"""The rubric of dataset tasks (env.py): the answer checked as the task says.

One criterion, `correct` (weight 1), reading `spec["match"]` of the task:

- `exact`: the final answer equals `spec["answer"]`, ignoring case and runs of whitespace;
- `numeric`: the last number in the answer equals the expected number (relative 1e-6;
  `1,234` and `1234.0` read as 1234);
- `regex`: the stripped answer fully matches the pattern `spec["answer"]`;
- `module:function`: your criterion, `(rollout, task) -> (score in [0, 1], reason)` like
  those of libs.reward.criteria (a bare number or bool is taken as the score).
"""

from __future__ import annotations

import math
import re
from typing import Any

from libs.domains.dataset.env import import_criterion
from libs.reward.criteria import normalized
from libs.reward.rubric import Criterion, Rubric, final_assistant_text
from proto.messages import Rollout, Task

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def answer_correct(rollout: Rollout, task: Task) -> tuple[float, str]:
    """Score the final answer against spec["answer"] by spec["match"]."""
    match = str(task.spec.get("match", "exact"))
    expected = str(task.spec["answer"])
    answer = final_assistant_text(rollout)
    if match == "exact":
        right = normalized(answer) == normalized(expected)
        return float(right), f"answer {answer[-80:]!r} {'=' if right else '!='} {expected!r}"
    if match == "numeric":
        return numeric_match(answer, expected)
    if match == "regex":
        right = re.fullmatch(expected, answer.strip()) is not None
        return float(
            right
        ), f"answer {answer[-80:]!r} {'matches' if right else 'does not match'} /{expected}/"
    return user_criterion(match, rollout, task)


def numeric_match(answer: str, expected: str) -> tuple[float, str]:
    numbers = _NUMBER.findall(answer)
    if not numbers:
        return 0.0, f"no number in {answer[-80:]!r}, expected {expected}"
    got, want = _number(numbers[-1]), _number(expected)
    if got is None or want is None:
        return 0.0, f"cannot read {numbers[-1]!r} or {expected!r} as numbers"
    right = math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    return float(right), f"{numbers[-1]} {'=' if right else '!='} {expected}"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def user_criterion(path: str, rollout: Rollout, task: Task) -> tuple[float, str]:
    """Run the criterion `path` names; its score must be a number in [0, 1]."""
    result: Any = import_criterion(path)(rollout, task)
    score, reason = result if isinstance(result, tuple) else (result, f"{path} scored it")
    score = float(score)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"criterion {path} returned {score}, outside [0, 1]")
    return score, str(reason)


def dataset_rubric() -> Rubric:
    return Rubric([Criterion("correct", 1.0, answer_correct)], correct_criterion="correct")
