"""Resource limits of a sandboxed command, and which limit a finished command ran into.

Limits are rlimits set by `prlimit` inside the sandbox right before the command runs (so
bubblewrap itself is not limited), plus a wall-clock deadline the caller enforces and size
caps on captured output and the sandbox's /tmp and /dev/shm.
"""

from __future__ import annotations

import re
import signal

from pydantic import BaseModel, ConfigDict, Field

from libs.sandbox.base import LimitName

MIB = 1024 * 1024

SIGNAL_LIMITS: dict[int, LimitName] = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}
# What common runtimes print when an rlimit refuses them (the rlimit itself leaves no trace
# outside the process). Checked in this order, only for a failed command.
STDERR_MARKERS: tuple[tuple[LimitName, re.Pattern[bytes]], ...] = (
    (
        "processes",
        re.compile(
            rb"BlockingIOError: \[Errno 11\]|fork: (?:retry: )?Resource temporarily unavailable"
            rb"|Cannot fork|can't fork|can't start new thread"
        ),
    ),
    ("memory", re.compile(rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory")),
    ("file_size", re.compile(rb"File too large")),
)


class SandboxLimits(BaseModel):
    """Per-command limits. CPU, memory, processes and file size are per sandboxed command."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: int = Field(10, ge=1)
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU then, one second later, SIGKILL."""
    memory_bytes: int = Field(1024 * MIB, ge=16 * MIB)
    """Address space per process (RLIMIT_AS); allocations past it fail (MemoryError)."""
    max_processes: int = Field(64, ge=4)
    """Processes and threads of the sandbox user at once (RLIMIT_NPROC), bubblewrap's own
    init included."""
    file_size_bytes: int = Field(64 * MIB, ge=1)
    """Largest file a command may write (RLIMIT_FSIZE)."""
    open_files: int = Field(256, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    wall_s: float = Field(30.0, gt=0)
    """Wall-clock time per command; then the whole sandbox is killed."""
    output_bytes: int = Field(1 * MIB, ge=0)
    """Bytes of stdout and of stderr kept each; the rest is read and dropped."""
    tmp_bytes: int = Field(64 * MIB, ge=MIB)
    """Size of the sandbox's private /tmp and of its /dev/shm (each a tmpfs)."""

    def prlimit_args(self) -> list[str]:
        """`prlimit` options that set these rlimits (soft:hard) on the command it runs."""
        return [
            f"--cpu={self.cpu_s}:{self.cpu_s + 1}",
            f"--as={self.memory_bytes}",
            f"--nproc={self.max_processes}",
            f"--fsize={self.file_size_bytes}",
            f"--nofile={self.open_files}",
            "--core=0",
        ]


def infer_limit_hit(
    *, timed_out: bool, killed_by_signal: int | None, exit_code: int, stderr: bytes
) -> LimitName | None:
    """The limit that most likely ended a command, or None.

    "wall" is certain (the caller killed it). "cpu" and "file_size" come from the signal in
    the exit status (SIGXCPU, SIGXFSZ; a SIGKILL the caller did not send is the hard CPU
    limit). Memory, process-count and file-size limits that only make a call fail inside the
    process (MemoryError, EAGAIN from fork, EFBIG) are read from the error text common
    runtimes print. Sandboxed code can fake all but "wall" (exit 128+N, print the text): use
    the answer to report an environment error, never to compute a reward.
    """
    if killed_by_signal in SIGNAL_LIMITS:
        return SIGNAL_LIMITS[killed_by_signal]
    if killed_by_signal == signal.SIGKILL and not timed_out:
        return "cpu"
    if exit_code != 0:
        for name, pattern in STDERR_MARKERS:
            if pattern.search(stderr):
                return name
    return "wall" if timed_out else None
