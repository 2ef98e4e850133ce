"""Rubric of the `recall` long-horizon environment: the whole code, read with valid calls.

- exact_match (0.6): env_info answer_correct (every digit right, in order);
- digits (0.3): share of the code's positions answered right (partial credit, a denser signal);
- tool_calls (0.1): share of well-formed tool calls;
- env_ok (0): an env error that ended the episode, shown in the breakdown, not rewarded.
"""

from __future__ import annotations

from libs.reward.criteria import env_ok, exact_match, tool_call_validity
from libs.reward.rubric import Criterion, Rubric
from proto.messages import Rollout, Task


def digits_correct(rollout: Rollout, task: Task) -> tuple[float, str]:
    """env_info digits_correct; 0 when the episode ended without an answer."""
    share = rollout.env_info.get("digits_correct")
    if share is None:
        return 0.0, f"no answer: episode ended by {rollout.finish_reason}"
    return float(share), f"{float(share):.0%} of the digits right"


def recall_rubric() -> Rubric:
    return Rubric(
        [
            Criterion("exact_match", 0.6, exact_match),
            Criterion("digits", 0.3, digits_correct),
            Criterion("tool_calls", 0.1, tool_call_validity),
            Criterion("env_ok", 0.0, env_ok),
        ],
        correct_criterion="exact_match",
    )
