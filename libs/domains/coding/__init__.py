"""The `coding` domain: Python tasks in a sandbox, graded by hidden tests (see env.py)."""

from pathlib import Path

from libs.domains.coding.env import CodingConfig, CodingEnv, CodingEpisode
from libs.domains.coding.rubric import coding_rubric
from libs.domains.coding.tasks import ENV_NAME, CodingTask, CodingTasks, load_tasks
from libs.domains.domain import Domain

DOMAIN = Domain(
    name=ENV_NAME,
    folder=Path(__file__).resolve().parent,
    env=CodingEnv,
    rubric=coding_rubric,
    description="small Python projects fixed with file and test tools, graded by hidden tests",
)

__all__ = [
    "DOMAIN",
    "CodingConfig",
    "CodingEnv",
    "CodingEpisode",
    "CodingTask",
    "CodingTasks",
    "load_tasks",
]
