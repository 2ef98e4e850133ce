"""The `coding` domain: Python tasks in a sandbox, graded by hidden tests (see env.py)."""

from pathlib import Path

from libs.domains.coding.env import CodingConfig, CodingEnv, CodingEpisode
from libs.domains.coding.rubric import coding_rubric
from libs.domains.coding.tasks import ENV_NAME, CodingTask, CodingTasks, load_tasks
from libs.domains.domain import Domain

DOMAIN = Domain(ENV_NAME, Path(__file__).resolve().parent, CodingEnv, coding_rubric)

__all__ = [
    "DOMAIN",
    "CodingConfig",
    "CodingEnv",
    "CodingEpisode",
    "CodingTask",
    "CodingTasks",
    "load_tasks",
]
