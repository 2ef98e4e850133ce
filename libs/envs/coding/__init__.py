"""The built-in Python coding environment (`coding`): see env.py."""

from libs.envs.coding.env import CodingConfig, CodingEnv, CodingEpisode
from libs.envs.coding.tasks import CodingTask, CodingTasks, load_tasks

__all__ = ["CodingConfig", "CodingEnv", "CodingEpisode", "CodingTask", "CodingTasks", "load_tasks"]
