"""Sandbox config: which backend, its limits, and where working folders live."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.sandbox.limits import SandboxLimits

NOBODY_ID = 65534
RESERVED_MOUNTS = ("/", "/usr", "/etc", "/proc", "/dev", "/tmp", "/bin", "/lib", "/lib64")


class SandboxConfig(BaseModel):
    """How episodes' sandboxes are built; `type` picks the backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["bubblewrap"] = "bubblewrap"
    """Backend: "bubblewrap" (Linux namespaces, no daemon, no root needed)."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Per-command resource limits."""
    root_dir: Path | None = None
    """Folder that holds the working folders; None: <tmp>/rlpipe-sandboxes-<uid>."""
    mount_path: str = "/workspace"
    """Where the working folder appears inside the sandbox (the commands' cwd and HOME)."""
    host_uid: int = Field(NOBODY_ID, ge=1)
    """Host uid the sandbox runs as when rlpipe runs as root (the kernel ignores the
    process-count limit for root, even mapped into a user namespace)."""
    host_gid: int = Field(NOBODY_ID, ge=1)
    """Host gid the sandbox runs as when rlpipe runs as root."""
    bwrap_path: str = "bwrap"
    """The bubblewrap executable (name on PATH or absolute path)."""
    cgroups: Literal["auto", "required"] = "auto"
    """Per-sandbox cgroups (memory, process and CPU totals): "auto" uses them where the host
    lets this process make cgroups and logs a warning where not; "required" refuses to start
    without them."""

    @field_validator("mount_path")
    @classmethod
    def _absolute_and_free(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") in RESERVED_MOUNTS or ".." in value:
            raise ValueError(
                f"mount_path {value!r} must be an absolute path outside the system folders "
                f"{RESERVED_MOUNTS}, e.g. '/workspace'"
            )
        return value.rstrip("/")
