"""Criteria of the built-in arithmetic task (env.py).

- exact_match (0.8): the environment's verdict, or (for a rollout without one) the final
  answer, cut at its first non-digit, equals spec["answer"].
- format (0.2): 1.0 when the completion is only digits and the policy ended it itself
  (eos, not cut by max_tokens: stats num_truncated_turns 0), else 0.

No partial credit for merely starting with a digit: that rewards every digit alike, and a
randomly initialized policy drifts onto one digit before it learns which one. Seen on the
tiny byte-level policy (GRPO, 16 groups of 16 per step, AdamW lr 1e-3, copy task): with a
0.5 "starts with a digit" credit the mean reward was 0.27 after 240 steps (and stuck at 0.10
for 400 steps at lr 3e-3); without it, it rose from 0.006 to 0.89 within 120 steps. Exact
matches alone (about 1 in 262 samples at first) give enough variance with groups of 16.
"""

from __future__ import annotations

from libs.domains.arith.env import leading_digits
from libs.reward.rubric import Criterion, Rubric, final_assistant_text
from proto.messages import EPISODE_STAT_TRUNCATED_TURNS, Rollout, Task

EXACT_MATCH_WEIGHT = 0.8
FORMAT_WEIGHT = 0.2


def exact_match(rollout: Rollout, task: Task) -> tuple[float, str]:
    """The environment's verdict (env_info answer_correct) when it gave one, else the final
    answer's leading digits against spec["answer"]."""
    expected = str(task.spec["answer"])
    if "answer_correct" in rollout.env_info:
        if rollout.env_info["answer_correct"]:
            return 1.0, f"env: answer correct ({expected!r})"
        return 0.0, f"env: answer wrong, expected {expected!r}"
    answer = leading_digits(final_assistant_text(rollout))
    if answer == expected:
        return 1.0, f"answer {answer!r} is correct"
    return 0.0, f"answer {answer!r}, expected {expected!r}"


def answer_format(rollout: Rollout, task: Task) -> tuple[float, str]:
    text = final_assistant_text(rollout)
    cut = rollout.stats.get(EPISODE_STAT_TRUNCATED_TURNS, 0) > 0  # max_tokens ended it
    if text.isascii() and text.isdigit() and rollout.finish_reason == "stop" and not cut:
        return 1.0, "only digits, ended by the policy"
    ending = "cut at max_tokens" if cut else f"finish {rollout.finish_reason}"
    return 0.0, f"not only digits ended by eos ({len(text)} chars, {ending})"


def arith_rubric() -> Rubric:
    return Rubric(
        [
            Criterion("exact_match", EXACT_MATCH_WEIGHT, exact_match),
            Criterion("format", FORMAT_WEIGHT, answer_format),
        ],
        correct_criterion="exact_match",
    )
