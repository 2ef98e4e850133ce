"""Environments: the plug-in interface, the registry, the built-in environments (arith,
calc, coding, recall, and dataset: the rows of a user's file), and the bus client.

Importing this package registers the built-in environments.
"""

from libs.envs.arithmetic import ArithmeticEnv
from libs.envs.base import (
    Environment,
    Episode,
    Opening,
    StepResult,
    TaskSource,
    UnknownEnvError,
    env_names,
    make_env,
    register_env,
)
from libs.envs.calc import CalcEnv
from libs.envs.coding import CodingEnv
from libs.envs.dataset import DatasetEnv
from libs.envs.recall import RecallEnv

register_env(ArithmeticEnv.name, ArithmeticEnv)
register_env(CalcEnv.name, CalcEnv)
register_env(CodingEnv.name, CodingEnv)
register_env(DatasetEnv.name, DatasetEnv)
register_env(RecallEnv.name, RecallEnv)

__all__ = [
    "ArithmeticEnv",
    "CalcEnv",
    "CodingEnv",
    "DatasetEnv",
    "Environment",
    "Episode",
    "Opening",
    "RecallEnv",
    "StepResult",
    "TaskSource",
    "UnknownEnvError",
    "env_names",
    "make_env",
    "register_env",
]
