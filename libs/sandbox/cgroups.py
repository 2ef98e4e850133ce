"""One cgroup per sandbox: memory, process and CPU totals over all of its processes.

    host = find_cgroup_host()                  # once per factory: v1, v2 or none, and why
    cgroup = SandboxCgroup.create(host, limits)
    cgroup.add(pid)                            # before the process forks anything
    before = cgroup.counters(); ...; cgroup.counters().since(before).limit_hit()
    cgroup.remove()

Per-process rlimits cannot bound a process tree: eight children under a 256 MB address
space limit held 1.26 GB together. A cgroup's limits count every process in it, and its
event counters (OOM kills, forks refused) say which limit ended a command in a way the
sandboxed code cannot fake.

Cgroup v1 (a hierarchy per controller, e.g. /sys/fs/cgroup/{memory,pids,cpu}) and v2 (one
unified hierarchy) are both found from /proc/self/mountinfo and /proc/self/cgroup; sandbox
cgroups are made under this process's own cgroup (`rlpipe-sbx-<pid>-<n>`). Under v2 that
cgroup must delegate the memory, pids and cpu controllers to its children; if it also holds
processes (v2 forbids controllers there), this process moves itself into a leaf
`rlpipe-service` when it is the only one there, as a container's single service is.
When a controller cannot be used, `CgroupHost.missing` says why; the factory logs it, and
`SandboxConfig.cgroups = "required"` refuses to start instead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import re
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from libs.sandbox.base import LimitName
from libs.sandbox.limits import SandboxLimits

CONTROLLERS = ("memory", "pids", "cpu")
CGROUP_PREFIX = "rlpipe-sbx-"
SERVICE_LEAF = "rlpipe-service"
CPU_PERIOD_US = 100_000
REMOVE_WAIT_S = 5.0  # processes of a killed pid namespace take a moment to leave the cgroup
_names = itertools.count()


@dataclass(frozen=True)
class CgroupHost:
    """Where this process may make sandbox cgroups: a parent folder per usable controller."""

    version: Literal[1, 2] | None
    parents: dict[str, Path] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    """Controllers not enforced, each with the reason."""

    def describe(self) -> str:
        """One line for logs and `rlpipe sandbox check`: what is enforced, what is not."""
        if not self.parents:
            return f"none: {'; '.join(sorted(set(self.missing.values())))}"
        parents = sorted({str(p) for p in self.parents.values()})
        line = f"v{self.version}: {'+'.join(sorted(self.parents))} under {', '.join(parents)}"
        return line + "".join(f"; no {c}: {why}" for c, why in sorted(self.missing.items()))


@dataclass(frozen=True)
class CgroupCounters:
    """A cgroup's event counters (cumulative; `since` gives one command's share)."""

    oom_kills: int = 0
    forks_refused: int = 0
    cpu_throttled_periods: int = 0

    def since(self, before: CgroupCounters) -> CgroupCounters:
        return CgroupCounters(
            self.oom_kills - before.oom_kills,
            self.forks_refused - before.forks_refused,
            self.cpu_throttled_periods - before.cpu_throttled_periods,
        )

    def limit_hit(self) -> LimitName | None:
        """The limit these events prove was hit: an OOM kill, then a refused fork."""
        if self.oom_kills > 0:
            return "memory"
        return "processes" if self.forks_refused > 0 else None


@functools.cache
def find_cgroup_host() -> CgroupHost:
    """The cgroup hierarchies this process can make sandbox cgroups in, probed by doing it
    (once per process: under v2 it may move this process into a leaf)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        own = Path("/proc/self/cgroup").read_text()
    except OSError as exc:
        return _none(f"cannot read /proc/self: {exc}")
    found = cgroup_parents(mountinfo, own)
    if found.version == 2:
        found = _delegate_v2(found)
    usable, missing = {}, dict(found.missing)
    for controller, parent in found.parents.items():
        problem = _probe(parent)
        if problem:
            missing[controller] = problem
        else:
            usable[controller] = parent
            _remove_stale(parent)
    return CgroupHost(found.version if usable else None, usable, missing)


def cgroup_parents(mountinfo: str, own_cgroups: str) -> CgroupHost:
    """Each controller's folder for this process's own cgroup: v1 when controllers are on v1
    hierarchies, else v2 (pure: the texts of /proc/self/mountinfo and /proc/self/cgroup in,
    folders out; whether v2 delegates the controllers is read later)."""
    own: dict[str, str] = {}
    for line in own_cgroups.splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            own[name] = path
    v1, v2 = {}, None
    for fields in (line.split() for line in mountinfo.splitlines()):
        dash = fields.index("-")
        root, mount_point, fstype = fields[3], fields[4], fields[dash + 1]
        if fstype == "cgroup2" and "" in own:
            v2 = _under(Path(mount_point), root, own[""])
        elif fstype == "cgroup":
            options = fields[dash + 3].split(",")
            for controller in set(options) & set(CONTROLLERS):
                folder = _under(Path(mount_point), root, own.get(controller))
                if folder is not None:
                    v1[controller] = folder
    if v1:  # a hybrid host binds every controller it has to v1; its v2 mount has none
        missing = {c: "no cgroup v1 hierarchy has it" for c in CONTROLLERS if c not in v1}
        return CgroupHost(1, v1, missing)
    if v2 is not None:
        return CgroupHost(2, dict.fromkeys(CONTROLLERS, v2))
    return _none("no cgroup hierarchy is mounted (no /sys/fs/cgroup)")


def _under(mount_point: Path, root: str, own: str | None) -> Path | None:
    """`own` (a path in the hierarchy) as a folder under a mount of the hierarchy's `root`."""
    if own is None or not (own == root or own.startswith(root.rstrip("/") + "/")):
        return None
    return mount_point / own[len(root) :].lstrip("/")


def _none(reason: str) -> CgroupHost:
    return CgroupHost(None, {}, dict.fromkeys(CONTROLLERS, reason))


def _delegate_v2(found: CgroupHost) -> CgroupHost:
    """Enable the controllers for the children of this process's cgroup (v2)."""
    parent = found.parents["memory"]
    try:
        available = (parent / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return _none(f"cannot read {parent}/cgroup.controllers: {exc.strerror}")
    missing = {c: f"not delegated to {parent}" for c in CONTROLLERS if c not in available}
    wanted = [c for c in CONTROLLERS if c not in missing]
    problem = _enable_v2(parent, wanted)
    if problem:
        return _none(problem)
    return CgroupHost(2, dict.fromkeys(wanted, parent), missing)


def _enable_v2(parent: Path, controllers: list[str]) -> str:
    """Enable `controllers` in parent's subtree_control; "" or why not."""
    control = parent / "cgroup.subtree_control"
    enable = " ".join(f"+{c}" for c in controllers)
    try:
        control.write_text(enable)
        return ""
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            return f"cannot enable controllers in {control}: {exc.strerror}"
    # v2 allows no processes in a cgroup whose children have controllers.
    procs = (parent / "cgroup.procs").read_text().split()
    if procs != [str(os.getpid())]:
        return (
            f"{parent} holds other processes ({len(procs)}), and cgroup v2 allows no process "
            "beside child cgroups: start rlpipe in a cgroup of its own with the controllers "
            "delegated (e.g. systemd-run --user --scope -p Delegate=yes ...)"
        )
    try:
        (parent / SERVICE_LEAF).mkdir(exist_ok=True)
        (parent / SERVICE_LEAF / "cgroup.procs").write_text(str(os.getpid()))
        control.write_text(enable)
    except OSError as exc:
        return f"cannot move this process into {parent / SERVICE_LEAF}: {exc.strerror}"
    return ""


def _probe(parent: Path) -> str:
    """ "" when a child cgroup can be made (and removed) in `parent`, else why not."""
    probe = parent / f"{CGROUP_PREFIX}{os.getpid()}-probe"
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as exc:
        return f"cannot make cgroups in {parent}: {exc.strerror}"
    return ""


def _remove_stale(parent: Path) -> None:
    """Remove empty sandbox cgroups left by processes that died without removing them."""
    for child in parent.glob(f"{CGROUP_PREFIX}*"):
        owner = re.match(rf"{CGROUP_PREFIX}(\d+)-", child.name)
        if owner and not Path(f"/proc/{owner.group(1)}").exists():
            with contextlib.suppress(OSError):
                child.rmdir()


class SandboxCgroup:
    """The cgroup (one folder per controller under v1) of one sandbox."""

    def __init__(self, host: CgroupHost, name: str) -> None:
        self.version = host.version
        self.paths = {c: parent / name for c, parent in host.parents.items()}
        self.folders = sorted(set(self.paths.values()))

    @classmethod
    def create(cls, host: CgroupHost, limits: SandboxLimits) -> SandboxCgroup:
        """A new cgroup with `limits`' memory total, process count and CPU share."""
        cgroup = cls(host, f"{CGROUP_PREFIX}{os.getpid()}-{next(_names)}")
        try:
            for folder in cgroup.folders:
                folder.mkdir()
            for name, value in cgroup._limit_files(limits):
                name.write_text(value)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def _limit_files(self, limits: SandboxLimits) -> list[tuple[Path, str]]:
        memory, pids, cpu = (self.paths.get(c) for c in CONTROLLERS)
        total, quota_us = str(limits.memory_total_bytes), round(limits.cpu_cores * CPU_PERIOD_US)
        files: list[tuple[Path, str]] = []
        if memory is not None and self.version == 1:
            files.append((memory / "memory.limit_in_bytes", total))
            files += _if_present(memory / "memory.memsw.limit_in_bytes", total)  # no swap
        elif memory is not None:
            files += [(memory / "memory.max", total), (memory / "memory.oom.group", "1")]
            files += _if_present(memory / "memory.swap.max", "0")
        if pids is not None:
            files.append((pids / "pids.max", str(limits.max_processes)))
        if cpu is not None and self.version == 1:
            files.append((cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US)))
            files.append((cpu / "cpu.cfs_quota_us", str(quota_us)))
        elif cpu is not None:
            files.append((cpu / "cpu.max", f"{quota_us} {CPU_PERIOD_US}"))
        return files

    def allow_exited(self, max_processes: int) -> None:
        """Set pids.max to `max_processes` plus the exited processes the kernel still counts.

        The first process of a pid namespace (each command has one: bubblewrap's pid 1)
        stays counted for a second or two after it is reaped; back-to-back commands would
        otherwise find the limit taken by the dead. Those only drain, so the live processes
        get at most `max_processes` plus what drains during the command."""
        pids = self.paths.get("pids")
        if pids is None:
            return
        tasks = pids / ("tasks" if self.version == 1 else "cgroup.threads")
        with contextlib.suppress(OSError, ValueError):
            exited = int((pids / "pids.current").read_text()) - len(tasks.read_text().split())
            (pids / "pids.max").write_text(str(max_processes + max(0, exited)))

    def add(self, pid: int) -> None:
        """Move process `pid` in; what it forks afterwards starts in the cgroup."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(pid))

    def counters(self) -> CgroupCounters:
        memory, pids, cpu = (self.paths.get(c) for c in CONTROLLERS)
        oom_file = "memory.oom_control" if self.version == 1 else "memory.events"
        return CgroupCounters(
            oom_kills=_read_key(memory and memory / oom_file, "oom_kill"),
            forks_refused=_read_key(pids and pids / "pids.events", "max"),
            cpu_throttled_periods=_read_key(cpu and cpu / "cpu.stat", "nr_throttled"),
        )

    def remove(self) -> None:
        """Kill what is left inside and remove the folders (bounded wait; never raises)."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        for folder in self.folders:
            while folder.exists():
                _kill_members(folder)
                with contextlib.suppress(OSError):
                    folder.rmdir()
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)  # a just-exited pid 1 keeps it busy for a few ms


def _if_present(path: Path, value: str) -> list[tuple[Path, str]]:
    return [(path, value)] if path.exists() else []


def _read_key(path: Path | None, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file ("key value" lines); 0 if absent."""
    if path is None:
        return 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _kill_members(folder: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in _pids(folder.joinpath("cgroup.procs").read_text().split()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _pids(words: Iterable[str]) -> list[int]:
    return [int(word) for word in words if word.isdigit()]
