"""Isolated execution of agent commands: one sandbox per episode (see base.py for the API)."""

from libs.sandbox.base import LimitName, Sandbox, SandboxError, SandboxFactory, SandboxResult
from libs.sandbox.config import SandboxConfig
from libs.sandbox.factory import build_sandbox_factory
from libs.sandbox.limits import SandboxLimits

__all__ = [
    "LimitName",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxFactory",
    "SandboxLimits",
    "SandboxResult",
    "build_sandbox_factory",
]
