"""A sandbox's working folder: a tmpfs of `disk_bytes` (the disk quota), held by a keeper.

    keeper = await Keeper.start(prefix, bwrap, home, disk_bytes)  # copies home/seed in
    keeper.workdir        # the folder, read from the host (/proc/<keeper>/root/...)
    keeper.enter_args()   # `nsenter` into its namespaces: each command's bubblewrap runs there
    await keeper.stop()   # the tmpfs and everything in it are gone

Why a tmpfs, and why a keeper. A quota on the host's disk (project quotas, a loop-mounted
image) needs root on the host and the right to mount block devices, which a container does
not get; a tmpfs mounted in a user namespace needs neither: unprivileged bubblewrap mounts
one with `--size N --tmpfs DIR`, and writes past N fail with ENOSPC. But that mount lives
only in the namespace that made it, and each command runs in fresh namespaces, while the
folder must outlive them (an episode writes, runs, writes again; grading reads it after).
So one idle process per sandbox holds it: bubblewrap over the host's own / with the tmpfs
at `home/disk`, running `cat` on a pipe from us. Each command's bubblewrap starts inside
the keeper's user and mount namespaces (`nsenter`), where `home/disk` is the tmpfs and
every other path is the host's; the host reads the files through /proc/<keeper>/root.
The folder lives in RAM, so its files count in the sandbox's memory total.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from libs.sandbox.base import SandboxError

# Runs in the keeper: copy the staged seed into the tmpfs, say our pid, then idle until our
# stdin (a pipe from the factory) closes. `cp` runs as the sandbox's host uid, the owner of
# the tmpfs; the host's root could not create files there (its uid is not mapped).
KEEPER_SCRIPT = 'cp -R -P --preserve=mode,timestamps "$1"/. "$2"/ && echo "$$" && exec cat'
START_TIMEOUT_S = 60.0  # a large seed is copied before the keeper reports
STOP_TIMEOUT_S = 5.0


class Keeper:
    """The process that holds one sandbox's working folder (a size-limited tmpfs)."""

    def __init__(self, proc: asyncio.subprocess.Process, pid: int, disk: Path) -> None:
        self.proc = proc
        self.pid = pid
        """Host pid of the keeper's `cat`: the target of `nsenter`."""
        self.disk = disk
        """Where the tmpfs is mounted inside the keeper's mount namespace."""

    @classmethod
    async def start(cls, prefix: list[str], bwrap: str, home: Path, disk_bytes: int) -> Keeper:
        """Mount a tmpfs of `disk_bytes` at home/disk, fill it from home/seed, hold it."""
        disk = home / "disk"
        argv = [
            *(*prefix, bwrap, "--unshare-user", "--die-with-parent", "--dev-bind", "/", "/"),
            *("--size", str(disk_bytes), "--tmpfs", str(disk), "--"),
            *("sh", "-c", KEEPER_SCRIPT, "keeper", str(home / "seed"), str(disk)),
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            if not line.strip().isdigit():
                raise SandboxError(_why_not_started(await _stderr(proc), disk_bytes))
            keeper = cls(proc, int(line), disk)
            await asyncio.to_thread(keeper.check_reachable)
        except BaseException:
            await _kill_and_wait(proc)
            raise
        return keeper

    @property
    def workdir(self) -> Path:
        """The working folder as the host reaches it (through the keeper's root)."""
        return Path(f"/proc/{self.pid}/root") / self.disk.relative_to("/")

    def enter_args(self, nsenter: str) -> list[str]:
        """The command prefix that runs what follows in the keeper's user and mount
        namespaces, with its own uid (the owner of those namespaces)."""
        return [
            nsenter,
            f"--target={self.pid}",
            "--user",
            "--mount",
            "--preserve-credentials",
            "--",
        ]

    def check_reachable(self) -> None:
        try:
            os.stat(self.workdir)
        except PermissionError as exc:
            raise SandboxError(
                f"cannot read the sandbox's working folder through {self.workdir}: run rlpipe "
                "as the same user as the sandboxes, or as root with CAP_SYS_PTRACE"
            ) from exc

    def kill(self) -> None:
        """SIGKILL the keeper now (its tmpfs goes with its mount namespace)."""
        _kill(self.proc)

    async def stop(self) -> None:
        """End the keeper: close its pipe, then kill it if it lingers; wait until it is gone."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            await _kill_and_wait(self.proc)


def _why_not_started(stderr: str, disk_bytes: int) -> str:
    if "No space left on device" in stderr:
        return (
            f"the seed folder does not fit the sandbox's disk quota (disk_bytes={disk_bytes}): "
            "raise disk_bytes or give a smaller seed"
        )
    return f"bubblewrap could not start the sandbox's working folder: {stderr.strip()}"


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        return (await proc.stderr.read()).decode(errors="replace")
    return "(no answer)"


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _kill_and_wait(proc: asyncio.subprocess.Process) -> None:
    _kill(proc)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
