"""Resource limits of a sandbox, and which limit a finished command ran into.

Two layers. Totals over every process of the sandbox, from its cgroup (libs.sandbox.cgroups:
memory, processes, CPU share) and the size of its working folder (a tmpfs). Per process,
rlimits set by `prlimit` right before the command runs (so bubblewrap itself is not limited):
CPU seconds, address space, file size, open files, and processes of the sandbox user (the
only process bound where the host gives no cgroups). Besides: a wall-clock deadline the
caller enforces, and size caps on captured output and the sandbox's /tmp and /dev/shm.
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
    ("disk", re.compile(rb"No space left on device|Disk quota exceeded")),
)


class SandboxLimits(BaseModel):
    """A sandbox's limits: totals over all its processes (`memory_total_bytes`,
    `cpu_cores`, `max_processes`, `disk_bytes`) and per-process rlimits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: int = Field(10, ge=1)
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU then, one second later, SIGKILL."""
    memory_bytes: int = Field(1024 * MIB, ge=16 * MIB)
    """Address space per process (RLIMIT_AS); allocations past it fail (MemoryError)."""
    memory_total_bytes: int = Field(2048 * MIB, ge=32 * MIB)
    """Memory of all the sandbox's processes together, files in its working folder, /tmp
    and /dev/shm included (all in RAM), from its cgroup; past it the kernel kills one."""
    cpu_cores: float = Field(1.0, ge=0.01)
    """CPU share of all the sandbox's processes together (cgroup CPU bandwidth), so a
    command's CPU time is at most cpu_cores x its wall-clock limit."""
    max_processes: int = Field(64, ge=4)
    """Processes and threads of the sandbox at once, bubblewrap's pid 1 of each command
    included: its cgroup's pids.max; without a pids cgroup, RLIMIT_NPROC of each command
    (with one, twice this, a backstop that lets the cgroup refuse first and record it)."""
    disk_bytes: int = Field(256 * MIB, ge=MIB)
    """Size of the working folder (a tmpfs, so also counted in memory_total_bytes);
    writes past it fail (ENOSPC), and a seed larger than it cannot be opened."""
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

    def prlimit_args(self, *, nproc: int) -> list[str]:
        """`prlimit` options that set these rlimits (soft:hard) on the command it runs;
        `nproc`: RLIMIT_NPROC (max_processes, or a backstop above the cgroup's pids.max)."""
        return [
            f"--cpu={self.cpu_s}:{self.cpu_s + 1}",
            f"--as={self.memory_bytes}",
            f"--nproc={nproc}",
            f"--fsize={self.file_size_bytes}",
            f"--nofile={self.open_files}",
            "--core=0",
        ]


def infer_limit_hit(
    *, timed_out: bool, killed_by_signal: int | None, exit_code: int, stderr: bytes
) -> LimitName | None:
    """The limit that most likely ended a command, or None, judged from the command alone
    (the cgroup's event counters, which the backend checks first, are surer).

    "wall" is certain (the caller killed it). "cpu" and "file_size" come from the signal in
    the exit status (SIGXCPU, SIGXFSZ; a SIGKILL the caller did not send is the hard CPU
    limit). Memory, process-count and file-size limits that only make a call fail inside the
    process (MemoryError, EAGAIN from fork, EFBIG, ENOSPC) are read from the error text common
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
