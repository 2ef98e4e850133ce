"""The sandbox interface every backend implements, and what one command's run returns.

A `SandboxFactory` opens sandboxes; each episode gets its own, with a private working folder
seeded from a directory and removed when the `async with` block ends:

    async with factory.open(seed_dir) as sandbox:
        result = await sandbox.run(["python3", "main.py"], timeout_s=10)
        if result.limit_hit: ...   # an environment error, not a crash of the caller

`run` never raises for what the command does (crash, limit, timeout); it raises
`SandboxError` only when the sandbox itself could not be set up.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LimitName = Literal["wall", "cpu", "memory", "processes", "file_size", "disk"]


class SandboxError(RuntimeError):
    """The sandbox could not be set up or run (not: the command inside failed)."""


@dataclass(frozen=True)
class SandboxResult:
    """How one command in a sandbox ended.

    `exit_code` follows the shell convention: 128 + N when the command was killed by
    signal N (then `killed_by_signal` is N). `limit_hit` names the limit that ended or broke
    the command; see `libs.sandbox.limits.infer_limit_hit` for how far it can be trusted.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    killed_by_signal: int | None
    limit_hit: LimitName | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """The command exited 0 within every limit."""
        return self.exit_code == 0 and self.limit_hit is None


class Sandbox(abc.ABC):
    """One isolated working folder and the commands run against it."""

    workdir: Path
    """The working folder as the host reaches it (read the agent's final files here, never
    following symlinks: the sandboxed code may have planted links to host paths). For the
    bubblewrap backend it is the sandbox's own size-limited tmpfs, reached through its
    keeper process; the host only reads it."""
    mount_path: str
    """Where the working folder appears inside the sandbox (the commands' cwd)."""

    @abc.abstractmethod
    async def run(
        self,
        command: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run `command` inside the sandbox; `timeout_s` overrides the wall-clock limit."""


class SandboxFactory(abc.ABC):
    """Opens sandboxes with one backend and one set of limits."""

    enforcement: Mapping[str, str]
    """What bounds a sandbox on this host, one line per mechanism (seccomp, cgroup, disk,
    rlimits); a mechanism the host does not give says "none: <why>"."""

    @abc.abstractmethod
    def open(self, seed_dir: Path | None = None) -> AbstractAsyncContextManager[Sandbox]:
        """A sandbox whose working folder is a copy of `seed_dir` (empty when None);
        the folder and every process started in it are gone when the block ends."""
