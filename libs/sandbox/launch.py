"""Starting one sandboxed command's bubblewrap, feeding and reading it, and killing it.

    launched = await Launched.start(argv_of, with_stdin=..., seccomp=program, cgroup=cgroup)
    outcome = await communicate(launched, stdin, deadline_s, cap)
    await launched.kill_and_reap(); status = await launched.rest_of_status()

`argv_of(fds)` builds the command line once the pipes exist: bubblewrap reports the host pid
of its sandbox's pid 1 on `fds.status` (--json-status-fd), reads the seccomp program from
`fds.seccomp` (--seccomp) and waits on `fds.block` (--block-fd) before it forks anything.
Meanwhile we move that pid into the sandbox's cgroup, so every process the command starts
is born inside it; then we let it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from libs.sandbox.base import SandboxError
from libs.sandbox.cgroups import SandboxCgroup

KILL_GRACE_S = 5.0  # how long pipes may take to close after the sandbox is killed
START_TIMEOUT_S = 60.0  # bubblewrap reports its sandbox's pid within this, even when busy
READ_BYTES = 64 * 1024

Outcome = tuple[bytes, bool, bytes, bool, bool]  # stdout, truncated, stderr, truncated, timed out


@dataclass(frozen=True)
class LaunchFds:
    """The descriptors bubblewrap gets, by their number in its process."""

    status: int
    seccomp: int
    block: int


async def communicate(
    launched: Launched, stdin: bytes | None, deadline_s: float, cap: int
) -> Outcome:
    """Feed stdin, read both pipes up to `cap` bytes each, kill at the deadline."""
    proc = launched.proc
    assert proc.stdout is not None and proc.stderr is not None
    out = asyncio.create_task(_read_capped(proc.stdout, cap))
    err = asyncio.create_task(_read_capped(proc.stderr, cap))
    waiter = asyncio.create_task(proc.wait())
    feeder = asyncio.create_task(_feed(proc.stdin, stdin))
    try:
        _, pending = await asyncio.wait((out, err, waiter), timeout=deadline_s)
        timed_out = bool(pending)
        if timed_out:
            launched.kill()
            await asyncio.wait(pending, timeout=KILL_GRACE_S)
        stdout, out_cut = out.result() if out.done() else (b"", True)
        stderr, err_cut = err.result() if err.done() else (b"", True)
        return stdout, out_cut, stderr, err_cut, timed_out
    finally:
        for task in (out, err, waiter, feeder):
            task.cancel()


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Everything the stream gives until EOF, keeping the first `cap` bytes."""
    chunks: list[bytes] = []
    size = 0
    while data := await stream.read(READ_BYTES):
        if size < cap:
            chunks.append(data[: cap - size])
        size += len(data)
    return b"".join(chunks), size > cap


async def _feed(pipe: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if pipe is None or data is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        pipe.write(data)
        await pipe.drain()
        pipe.close()


class Launched:
    """A started outer bubblewrap, and the host pid of its sandbox's pid 1 (`child_pid`).

    Killing pid 1 of a pid namespace makes the kernel kill every process in it. We kill it
    directly, not only through bubblewrap's die-with-parent: a sandbox whose outer
    bubblewrap dies during setup can miss its parent-death signal and live on."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        status: asyncio.StreamReader,
        transport: asyncio.BaseTransport,
    ) -> None:
        self.proc = proc
        self.status = status
        self.transport = transport
        self.child_pid: int | None = None
        self.first_status = b""

    @classmethod
    async def start(
        cls,
        argv_of: Callable[[LaunchFds], list[str]],
        *,
        with_stdin: bool,
        seccomp: bytes,
        cgroup: SandboxCgroup | None,
    ) -> Launched:
        """Start bubblewrap, put its sandbox in `cgroup` and let it run; a cancel that lands
        meanwhile still waits for the sandbox's pid, then kills the sandbox."""
        starting = asyncio.ensure_future(cls._start(argv_of, with_stdin, seccomp, cgroup))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            launched = await starting
            await launched.kill_and_reap()
            launched.transport.close()
            raise

    @classmethod
    async def _start(
        cls,
        argv_of: Callable[[LaunchFds], list[str]],
        with_stdin: bool,
        seccomp: bytes,
        cgroup: SandboxCgroup | None,
    ) -> Launched:
        (status_r, status_w), (block_r, block_w) = os.pipe(), os.pipe()
        seccomp_r = _pipe_holding(seccomp)
        theirs = LaunchFds(status=status_w, seccomp=seccomp_r, block=block_r)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv_of(theirs),
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w, seccomp_r, block_r),
            )
        except BaseException:
            os.close(status_r)
            os.close(block_w)
            raise
        finally:
            for fd in (status_w, seccomp_r, block_r):
                os.close(fd)  # bubblewrap holds its own copies
        status = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(status), os.fdopen(status_r, "rb", 0)
        )
        launched = cls(proc, status, transport)
        try:
            await launched._read_child_pid()
            launched._release(block_w, cgroup)
        except BaseException:
            await launched.kill_and_reap()
            transport.close()
            raise
        finally:
            os.close(block_w)
        return launched

    async def _read_child_pid(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, TimeoutError):
            # bubblewrap writes {"child-pid": N, ...} right after cloning the sandbox.
            self.first_status = await asyncio.wait_for(self.status.readuntil(b"}"), START_TIMEOUT_S)
            self.child_pid = int(json.loads(self.first_status)["child-pid"])

    def _release(self, block_fd: int, cgroup: SandboxCgroup | None) -> None:
        """Move the waiting sandbox into its cgroup, then let it fork and exec."""
        if self.child_pid is None:
            return  # bubblewrap failed before cloning; its status says why
        if cgroup is not None:
            try:
                cgroup.add(self.child_pid)
            except OSError as exc:
                self.kill()
                raise SandboxError(f"cannot move the sandbox into its cgroup: {exc}") from exc
        with contextlib.suppress(BrokenPipeError):
            os.write(block_fd, b"x")

    def kill(self) -> None:
        """SIGKILL the sandbox's pid 1 and the outer bubblewrap's process group."""
        if self.proc.returncode is not None:
            return  # bubblewrap reaped pid 1 before it exited
        for kill, pid in ((os.kill, self.child_pid), (os.killpg, self.proc.pid)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)

    async def kill_and_reap(self) -> None:
        """Kill the sandbox if it still runs; wait (bounded) until it has been reaped."""
        self.kill()
        if self.proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), KILL_GRACE_S)

    async def rest_of_status(self) -> bytes:
        """All status bubblewrap wrote (it and its sandbox are gone, so EOF is near)."""
        try:
            rest = await asyncio.wait_for(self.status.read(), KILL_GRACE_S)
        except TimeoutError:
            rest = b""
        self.transport.close()
        return self.first_status + rest


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds `data` (a pipe buffers 64 KiB; a filter is <1 KiB)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)
    finally:
        os.close(write_end)
    return read_end
