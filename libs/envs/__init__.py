"""Environments: the plug-in interface, the registry, the built-in task, and the bus client.

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

register_env(ArithmeticEnv.name, ArithmeticEnv)

__all__ = [
    "ArithmeticEnv",
    "Environment",
    "Episode",
    "Opening",
    "StepResult",
    "TaskSource",
    "UnknownEnvError",
    "env_names",
    "make_env",
    "register_env",
]
