"""The one factory that builds the sandbox backend a config's `type` names.

factory = build_sandbox_factory(SandboxConfig(limits=SandboxLimits(cpu_s=5)))
async with factory.open(task_dir) as sandbox:
    result = await sandbox.run(["python3", "-m", "pytest", "-q"])
"""

from __future__ import annotations

from libs.sandbox.base import SandboxFactory
from libs.sandbox.bubblewrap import BubblewrapSandboxFactory
from libs.sandbox.config import SandboxConfig


def build_sandbox_factory(config: SandboxConfig | None = None) -> SandboxFactory:
    """The sandbox factory `config.type` names (default: bubblewrap, default limits)."""
    config = config or SandboxConfig()
    if config.type == "bubblewrap":
        return BubblewrapSandboxFactory(config)
    raise ValueError(f"sandbox type {config.type!r} is unknown: use 'bubblewrap'")
