"""The bubblewrap sandbox backend: one set of Linux namespaces per command, no daemon.

Inside, a command sees: the host's /usr (and the /bin, /lib* links or folders) read-only, so
`python3` is the system interpreter, never a virtualenv; a minimal /etc (loader cache,
alternatives, python config, a synthetic passwd/group); a fresh /proc, a minimal /dev, its
own size-limited /tmp and /dev/shm; the working folder read-write at `mount_path`; nothing
else (no home, no repository). It runs as uid/gid 1000 in new user, pid, net (only a down
loopback), ipc, uts and cgroup namespaces, in a new session, without the right to create
further user namespaces, under a seccomp filter (libs.sandbox.seccomp) and rlimits set by
`prlimit`.

Each sandbox (one episode) has: a working folder that is a tmpfs of `disk_bytes`, held by a
keeper process (libs.sandbox.keeper), inside whose namespaces each command's bubblewrap
starts; and a cgroup (libs.sandbox.cgroups) that bounds the memory, processes and CPU of all
its commands together, where the host lets us make one. `factory.enforcement` says what is
in effect on this host; the factory logs it, with a warning when cgroups are missing.

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
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import structlog

from libs.sandbox.base import LimitName, Sandbox, SandboxError, SandboxFactory, SandboxResult
from libs.sandbox.cgroups import CgroupHost, SandboxCgroup, find_cgroup_host
from libs.sandbox.config import SandboxConfig
from libs.sandbox.keeper import Keeper
from libs.sandbox.launch import Launched, LaunchFds, Outcome, communicate
from libs.sandbox.limits import SandboxLimits, infer_limit_hit
from libs.sandbox.rootfs import (
    SANDBOX_ID,
    check_seed_dir,
    chown_tree,
    prepare_root,
    remove_tree,
    system_mount_args,
    write_etc,
)
from libs.sandbox.seccomp import build_filter, denied_syscalls, machine_name

log = structlog.get_logger(__name__)
UTIL_LINUX = "install util-linux (it ships {})"


class BubblewrapSandboxFactory(SandboxFactory):
    """Opens bubblewrap sandboxes; checks the tools and prepares the root folder once."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.bwrap = _require_executable(config.bwrap_path, "install bubblewrap (apt bubblewrap)")
        self.prlimit = _require_executable("prlimit", UTIL_LINUX.format("prlimit"))
        self.nsenter = _require_executable("nsenter", UTIL_LINUX.format("nsenter"))
        try:
            self.seccomp = build_filter()
        except ValueError as exc:
            raise SandboxError(str(exc)) from exc
        self.cgroups = _cgroup_host(config)
        self.run_as = (config.host_uid, config.host_gid) if os.geteuid() == 0 else None
        self.drop_root = self._drop_root_prefix()
        default_root = Path(tempfile.gettempdir()) / f"rlpipe-sandboxes-{os.geteuid()}"
        self.root_dir = prepare_root(config.root_dir or default_root)
        self.system_args = system_mount_args(write_etc(self.root_dir, config.mount_path))
        self.enforcement = self._enforcement()
        _log_enforcement(self.enforcement, self.cgroups)

    @contextlib.asynccontextmanager
    async def open(self, seed_dir: Path | None = None) -> AsyncIterator[Sandbox]:
        if seed_dir is not None:
            await asyncio.to_thread(check_seed_dir, Path(seed_dir), self.root_dir)
        home = await asyncio.to_thread(self._create_home, seed_dir)
        keeper: Keeper | None = None
        cgroup: SandboxCgroup | None = None
        try:
            keeper = await Keeper.start(self.drop_root, self.bwrap, home, self.limits.disk_bytes)
            await asyncio.to_thread(remove_tree, home / "seed")  # now copied into the tmpfs
            (home / "work").symlink_to(keeper.workdir)
            if self.cgroups.parents:
                cgroup = await asyncio.to_thread(SandboxCgroup.create, self.cgroups, self.limits)
            sandbox = BubblewrapSandbox(self, home / "work", keeper, cgroup)
            try:
                yield sandbox
            finally:
                sandbox.kill_all()
        finally:
            if keeper is not None:
                await keeper.stop()
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
            await asyncio.to_thread(remove_tree, home)

    @property
    def limits(self) -> SandboxLimits:
        return self.config.limits

    def _create_home(self, seed_dir: Path | None) -> Path:
        """home/ with seed/ (a copy of `seed_dir`, for the keeper to copy into the tmpfs)
        and disk/ (where the keeper mounts the tmpfs, in its own mount namespace)."""
        home = Path(tempfile.mkdtemp(prefix="sbx-", dir=self.root_dir))
        home.chmod(0o711)  # the sandbox user must reach disk/ through it, not list it
        seed = home / "seed"
        if seed_dir is None:
            seed.mkdir()
        else:
            shutil.copytree(seed_dir, seed, symlinks=True)
        (home / "disk").mkdir()
        if self.run_as is not None:
            chown_tree(seed, *self.run_as)
        return home

    def argv(
        self, keeper: Keeper, command: Sequence[str], env: Mapping[str, str], fds: LaunchFds
    ) -> list[str]:
        """The command line running `command` in the keeper's working folder."""
        mount = self.config.mount_path
        tmp_bytes = str(self.limits.tmp_bytes)
        nproc = self.limits.max_processes * (2 if "pids" in self.cgroups.parents else 1)
        env_args = [a for k, v in env.items() for a in ("--setenv", k, v)]
        return [
            *self.drop_root,
            *keeper.enter_args(self.nsenter),
            self.bwrap,
            *("--unshare-all", "--unshare-user", "--disable-userns"),
            *("--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--hostname", "sandbox"),
            *("--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"),
            *env_args,
            *self.system_args,
            *("--proc", "/proc", "--dev", "/dev"),
            *("--size", tmp_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"),
            *("--size", tmp_bytes, "--tmpfs", "/tmp"),
            *("--bind", str(keeper.disk), mount, "--remount-ro", "/", "--chdir", mount),
            *("--seccomp", str(fds.seccomp), "--block-fd", str(fds.block)),
            *("--json-status-fd", str(fds.status), "--"),
            *(self.prlimit, *self.limits.prlimit_args(nproc=nproc), "--", *command),
        ]

    def _drop_root_prefix(self) -> list[str]:
        """`setpriv` switching root to the sandbox's host uid before bubblewrap starts.

        Not subprocess's user=/group=: those make Python fork() instead of vfork(), and
        fork() copies the page tables of a big parent (51 ms instead of 12 ms per start
        with 1 GiB resident)."""
        if self.run_as is None:
            return []
        setpriv = _require_executable("setpriv", UTIL_LINUX.format("setpriv"))
        uid, gid = self.run_as
        return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]

    def _enforcement(self) -> dict[str, str]:
        """What bounds a sandbox on this host, by mechanism (for logs and `sandbox check`)."""
        limits = self.limits
        return {
            "seccomp": f"{machine_name()}: {len(denied_syscalls())} syscalls and namespace "
            "clones refused (EPERM), clone3 ENOSYS, other syscall ABIs refused",
            "cgroup": self.cgroups.describe(),
            "disk": f"working folder a tmpfs of {limits.disk_bytes} bytes per sandbox",
            "rlimits": "per process: CPU seconds, address space, file size, open files, "
            "processes of the sandbox user",
        }


def _cgroup_host(config: SandboxConfig) -> CgroupHost:
    host = find_cgroup_host()
    if config.cgroups == "required" and host.missing:
        raise SandboxError(
            f"sandbox cgroups are required (cgroups='required') but not usable here: "
            f"{host.describe()}; set cgroups='auto' to run with per-process limits only"
        )
    return host


def _log_enforcement(enforcement: dict[str, str], host: CgroupHost) -> None:
    if host.missing:
        log.warning(
            "sandbox totals not enforced by cgroups: where missing, memory and processes are "
            "bounded per process only (rlimits) and CPU per process and by the wall clock",
            missing=sorted(host.missing),
            **enforcement,
        )
    else:
        log.info("sandbox enforcement", **enforcement)


class BubblewrapSandbox(Sandbox):
    """One working folder; each `run` is a fresh set of namespaces over it."""

    def __init__(
        self,
        factory: BubblewrapSandboxFactory,
        workdir: Path,
        keeper: Keeper,
        cgroup: SandboxCgroup | None,
    ) -> None:
        self.factory = factory
        self.workdir = workdir
        self.mount_path = factory.config.mount_path
        self.keeper = keeper
        self.cgroup = cgroup
        """The sandbox's cgroup, or None where the host gives none."""
        self._live: set[Launched] = set()

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
        limits = self.factory.limits
        deadline_s = limits.wall_s if timeout_s is None else timeout_s
        full_env = {**self._base_env(), **(env or {})}
        argv_of = functools.partial(self.factory.argv, self.keeper, command, full_env)
        before = None
        if self.cgroup is not None:
            self.cgroup.allow_exited(limits.max_processes)
            before = self.cgroup.counters()
        started = time.perf_counter()
        launched = await Launched.start(
            argv_of, with_stdin=stdin is not None, seccomp=self.factory.seccomp, cgroup=self.cgroup
        )
        self._live.add(launched)
        try:
            outcome = await communicate(launched, stdin, deadline_s, limits.output_bytes)
        finally:
            self._live.discard(launched)
            await launched.kill_and_reap()
        status = await launched.rest_of_status()
        wall_s = time.perf_counter() - started
        proven = (
            self.cgroup.counters().since(before).limit_hit() if self.cgroup and before else None
        )
        return _result(launched.proc, outcome, status, wall_s, proven)

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


def _result(
    proc: asyncio.subprocess.Process,
    outcome: Outcome,
    status: bytes,
    wall_s: float,
    proven_limit: LimitName | None,
) -> SandboxResult:
    """The result; `proven_limit` (from the cgroup's events) outranks what is inferred."""
    stdout, out_cut, stderr, err_cut, timed_out = outcome
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    if not timed_out and b'"exit-code"' not in status:
        message = stderr.decode(errors="replace").strip()
        raise SandboxError(f"bubblewrap could not start the sandbox (exit {code}): {message}")
    # bubblewrap's pid 1 reports a command killed by signal N as exit 128 + N.
    signal_number = -code if code < 0 else (code - 128 if 128 < code <= 128 + 64 else None)
    exit_code = 128 + signal_number if signal_number is not None else code
    inferred = infer_limit_hit(
        timed_out=timed_out, killed_by_signal=signal_number, exit_code=exit_code, stderr=stderr
    )
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        killed_by_signal=signal_number,
        limit_hit=proven_limit or inferred,
        wall_s=wall_s,
        stdout_truncated=out_cut,
        stderr_truncated=err_cut,
    )


def _require_executable(name: str, fix: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"{name} not found on PATH: {fix}")
    return path
