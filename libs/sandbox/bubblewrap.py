"""The bubblewrap sandbox backend: one set of Linux namespaces per command, no daemon.

Inside, a command sees: the host's /usr (and the /bin, /lib* links or folders) read-only, so
`python3` is the system interpreter, never a virtualenv; a minimal /etc (loader cache,
alternatives, python config, a synthetic passwd/group); a fresh /proc, a minimal /dev, its
own size-limited /tmp and /dev/shm; the working folder read-write at `mount_path`; nothing
else (no home, no repository). It runs as uid/gid 1000 in new user, pid, net (only a down
loopback), ipc, uts and cgroup namespaces, in a new session, without the right to create
further user namespaces, under rlimits set by `prlimit`.

When rlpipe runs as root, bubblewrap is started as `host_uid` (nobody): the kernel skips
RLIMIT_NPROC for a process whose real uid is host root, even when mapped to another uid in a
user namespace; as an unprivileged host uid, the limit counts per sandbox (its user
namespace). Killing the outer bubblewrap ends the sandbox's pid 1 (die-with-parent), and the
kernel then kills every process in the pid namespace: nothing outlives a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from libs.sandbox.base import Sandbox, SandboxError, SandboxFactory, SandboxResult
from libs.sandbox.config import SandboxConfig
from libs.sandbox.limits import infer_limit_hit

SANDBOX_ID = 1000  # uid and gid of the command inside the sandbox
SYSTEM_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
KILL_GRACE_S = 5.0  # how long pipes may take to close after the sandbox is killed
READ_BYTES = 64 * 1024
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "sandbox:x:{id}:{id}:sandbox:{home}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nsandbox:x:{id}:\nnogroup:x:65534:\n"


class BubblewrapSandboxFactory(SandboxFactory):
    """Opens bubblewrap sandboxes; checks the tools and prepares the root folder once."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.bwrap = _require_executable(config.bwrap_path, "install bubblewrap (apt bubblewrap)")
        self.prlimit = _require_executable("prlimit", "install util-linux (it ships prlimit)")
        self.run_as = (config.host_uid, config.host_gid) if os.geteuid() == 0 else None
        self.drop_root = self._drop_root_prefix()
        default_root = Path(tempfile.gettempdir()) / f"rlpipe-sandboxes-{os.geteuid()}"
        self.root_dir = _prepare_root(config.root_dir or default_root)
        self.system_args = _system_mount_args(_write_etc(self.root_dir, config.mount_path))

    @contextlib.asynccontextmanager
    async def open(self, seed_dir: Path | None = None) -> AsyncIterator[Sandbox]:
        if seed_dir is not None:
            await asyncio.to_thread(check_seed_dir, Path(seed_dir), self.root_dir)
        home = await asyncio.to_thread(self._create_home, seed_dir)
        sandbox = BubblewrapSandbox(self, home / "work")
        try:
            yield sandbox
        finally:
            sandbox.kill_all()
            await asyncio.to_thread(_remove_tree, home)

    def _create_home(self, seed_dir: Path | None) -> Path:
        home = Path(tempfile.mkdtemp(prefix="sbx-", dir=self.root_dir))
        home.chmod(0o711)  # the sandbox user must reach work/ through it, not list it
        work = home / "work"
        if seed_dir is None:
            work.mkdir()
        else:
            shutil.copytree(seed_dir, work, symlinks=True)
        if self.run_as is not None:
            _chown_tree(work, *self.run_as)
        return home

    def argv(
        self, workdir: Path, command: Sequence[str], env: Mapping[str, str], fd: int
    ) -> list[str]:
        """The bubblewrap command line running `command` in `workdir`; status goes to `fd`."""
        mount = self.config.mount_path
        tmp_bytes = str(self.config.limits.tmp_bytes)
        env_args = [a for k, v in env.items() for a in ("--setenv", k, v)]
        return [
            *self.drop_root,
            self.bwrap,
            *("--unshare-all", "--unshare-user", "--disable-userns"),
            *("--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--hostname", "sandbox"),
            *("--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"),
            *env_args,
            *self.system_args,
            *("--proc", "/proc", "--dev", "/dev"),
            *("--size", tmp_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"),
            *("--size", tmp_bytes, "--tmpfs", "/tmp"),
            *("--bind", str(workdir), mount, "--remount-ro", "/", "--chdir", mount),
            *("--json-status-fd", str(fd), "--"),
            *(self.prlimit, *self.config.limits.prlimit_args(), "--", *command),
        ]

    def _drop_root_prefix(self) -> list[str]:
        """`setpriv` switching root to the sandbox's host uid before bubblewrap starts.

        Not subprocess's user=/group=: those make Python fork() instead of vfork(), and
        fork() copies the page tables of a big parent (51 ms instead of 12 ms per start
        with 1 GiB resident)."""
        if self.run_as is None:
            return []
        setpriv = _require_executable("setpriv", "install util-linux (it ships setpriv)")
        uid, gid = self.run_as
        return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]


class BubblewrapSandbox(Sandbox):
    """One working folder; each `run` is a fresh set of namespaces over it."""

    def __init__(self, factory: BubblewrapSandboxFactory, workdir: Path) -> None:
        self.factory = factory
        self.workdir = workdir
        self.mount_path = factory.config.mount_path
        self._live: set[_Launched] = set()

    async def run(
        self,
        command: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        if not command:
            raise ValueError("command is empty: give the program and its arguments")
        limits = self.factory.config.limits
        deadline_s = limits.wall_s if timeout_s is None else timeout_s
        full_env = {**self._base_env(), **(env or {})}
        argv_of = functools.partial(self.factory.argv, self.workdir, command, full_env)
        started = time.perf_counter()
        launched = await _Launched.start(argv_of, with_stdin=stdin is not None)
        self._live.add(launched)
        try:
            outcome = await _communicate(launched, stdin, deadline_s, limits.output_bytes)
        finally:
            self._live.discard(launched)
            await launched.kill_and_reap()
        status = await launched.rest_of_status()
        return _result(launched.proc, outcome, status, time.perf_counter() - started)

    def kill_all(self) -> None:
        """Kill every sandbox still running in this folder (a cancelled run's leftovers)."""
        for launched in list(self._live):
            launched.kill()

    def _base_env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.mount_path,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "USER": "sandbox",
        }


_Outcome = tuple[bytes, bool, bytes, bool, bool]  # stdout, truncated, stderr, truncated, timed out


async def _communicate(
    launched: _Launched, stdin: bytes | None, deadline_s: float, cap: int
) -> _Outcome:
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


class _Launched:
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
    async def start(cls, argv_of: Callable[[int], list[str]], *, with_stdin: bool) -> _Launched:
        """Start bubblewrap and wait for the pid of its sandbox; a cancel that lands
        meanwhile still waits for that pid, then kills the sandbox."""
        starting = asyncio.ensure_future(cls._start(argv_of, with_stdin))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            launched = await starting
            await launched.kill_and_reap()
            launched.transport.close()
            raise

    @classmethod
    async def _start(cls, argv_of: Callable[[int], list[str]], with_stdin: bool) -> _Launched:
        status_r, status_w = os.pipe()  # bubblewrap's --json-status-fd
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv_of(status_w),
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)  # bubblewrap holds its own copy
        status = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(status), os.fdopen(status_r, "rb", 0)
        )
        launched = cls(proc, status, transport)
        with contextlib.suppress(asyncio.IncompleteReadError, TimeoutError):
            # bubblewrap writes {"child-pid": N, ...} right after cloning the sandbox.
            launched.first_status = await asyncio.wait_for(status.readuntil(b"}"), KILL_GRACE_S)
            launched.child_pid = int(json.loads(launched.first_status)["child-pid"])
        return launched

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


def _result(
    proc: asyncio.subprocess.Process, outcome: _Outcome, status: bytes, wall_s: float
) -> SandboxResult:
    stdout, out_cut, stderr, err_cut, timed_out = outcome
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    if not timed_out and b'"exit-code"' not in status:
        message = stderr.decode(errors="replace").strip()
        raise SandboxError(f"bubblewrap could not start the sandbox (exit {code}): {message}")
    # bubblewrap's pid 1 reports a command killed by signal N as exit 128 + N.
    signal_number = -code if code < 0 else (code - 128 if 128 < code <= 128 + 64 else None)
    exit_code = 128 + signal_number if signal_number is not None else code
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        killed_by_signal=signal_number,
        limit_hit=infer_limit_hit(
            timed_out=timed_out,
            killed_by_signal=signal_number,
            exit_code=exit_code,
            stderr=stderr,
        ),
        wall_s=wall_s,
        stdout_truncated=out_cut,
        stderr_truncated=err_cut,
    )


def _require_executable(name: str, fix: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"{name} not found on PATH: {fix}")
    return path


MAX_SEED_BYTES = 1 << 30


def check_seed_dir(seed_dir: Path, root_dir: Path, max_bytes: int = MAX_SEED_BYTES) -> None:
    """Refuse a seed folder that cannot be copied into a sandbox.

    A seed holding the sandboxes' own root (`--workdir /tmp`) would copy itself into
    itself until the disk is full (it did, once); a huge seed is almost always a mistake.
    """
    if not seed_dir.is_dir():
        raise ValueError(f"seed_dir {seed_dir} is not a folder: give the task's files folder")
    seed, root = seed_dir.resolve(), root_dir.resolve()
    if root == seed or seed in root.parents:
        raise ValueError(
            f"seed_dir {seed_dir} contains the sandboxes' own folder {root_dir}: "
            "give the task's files folder, not a parent of it"
        )
    total = 0
    for folder, _, files in os.walk(seed):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(folder) / name).lstat().st_size
            if total > max_bytes:
                raise ValueError(
                    f"seed_dir {seed_dir} holds more than {max_bytes >> 20} MiB: a sandbox gets "
                    "a copy of it, so give a folder with just the task's files"
                )


def _prepare_root(root: Path) -> Path:
    """The folder of working folders, traversable (not listable) by the sandbox user."""
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise SandboxError(f"sandbox root {root} must be a folder owned by uid {os.geteuid()}")
    root.chmod(0o711)
    return root


def _write_etc(root: Path, mount_path: str) -> dict[str, Path]:
    """The synthetic /etc files, by their path inside the sandbox."""
    etc = root / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    return {
        "/etc/passwd": _write_once(etc, "passwd", PASSWD.format(id=SANDBOX_ID, home=mount_path)),
        "/etc/group": _write_once(etc, "group", GROUP.format(id=SANDBOX_ID)),
    }


def _write_once(folder: Path, stem: str, text: str) -> Path:
    """`folder/stem-<digest of text>`, written if absent and never replaced afterwards.

    Other factories (other processes, other mount paths) share the root, and their sandboxes
    may be binding these files right now: bubblewrap fails on a source replaced under it
    ("Unable to find ... (deleted) in mount table"), so a file, once there, stays as it is.
    """
    path = folder / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if path.exists():
        return path
    fd, temporary = tempfile.mkstemp(dir=folder)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o644)
        with contextlib.suppress(FileExistsError):  # another factory wrote the same text first
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
    return path


def _system_mount_args(etc_files: dict[str, Path]) -> list[str]:
    """Read-only /usr, the top-level /bin, /lib* (links kept links) and a minimal /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_TOP_DIRS:
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    etc_names = [*ETC_ENTRIES, *sorted(p.name for p in Path("/etc").glob("python3*"))]
    for name in etc_names:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for inside, source in etc_files.items():
        args += ["--ro-bind", str(source), inside]
    return args


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    os.chown(top, uid, gid, follow_symlinks=False)
    for folder, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)


def _remove_tree(top: Path) -> None:
    """Remove a working folder, even one whose modes the sandboxed code changed."""

    def make_writable_and_retry(function: Any, path: str, _exc: Any) -> None:
        parent = os.path.dirname(path)
        with contextlib.suppress(OSError, NotImplementedError):
            os.chmod(parent, 0o700)
            os.chmod(path, 0o700, follow_symlinks=False)
        with contextlib.suppress(FileNotFoundError):
            function(path)

    shutil.rmtree(top, onerror=make_writable_and_retry)
