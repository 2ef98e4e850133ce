"""echo's rubric: one criterion, the environment's verdict."""

from libs.reward.rubric import Criterion, Rubric
from proto.messages import Rollout, Task


def said_it(rollout: Rollout, task: Task) -> tuple[float, str]:
    right = bool(rollout.env_info.get("said_it"))
    return float(right), "said the word" if right else f"did not say {task.spec['word']!r}"


def echo_rubric() -> Rubric:
    return Rubric([Criterion("said_it", 1.0, said_it)], correct_criterion="said_it")
