"""Runs child processes, restarts the ones that crash, and stops them all without leftovers.

Each child runs in its own session (so its own process group): a terminal Ctrl-C reaches
only the launcher, and a stop can signal a child together with anything it spawned.
Output goes to `<log_dir>/<name>.log`, appended across restarts.

    supervisor = Supervisor([ChildSpec("echo", ["sleep", "60"])], log_dir=Path("logs"))
    await supervisor.start()
    ...
    await supervisor.stop(grace_s=15.0)
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.process_lifetime import die_with_parent

EventHandler = Callable[..., None]


@dataclass(frozen=True)
class ChildSpec:
    """What to run: `env` is added to the launcher's own environment."""

    name: str
    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Backoff:
    """Restart delays: `initial_s` doubling up to `max_s`; a child that stayed up
    `reset_after_s` counts as healthy again and restarts after `initial_s`."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay_s(self, num_failures: int) -> float:
        """Delay before the restart that follows `num_failures` crashes in a row (>= 1)."""
        return min(self.max_s, self.initial_s * 2 ** max(0, num_failures - 1))


@dataclass
class ChildState:
    """What the supervisor knows about one child; `state` is the process lifecycle:
    running -> (backoff -> running)* -> stopping -> stopped | killed | exited, or crashed when
    it was down (in backoff) as the stop came; failed when it could not be started again."""

    spec: ChildSpec
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    state: str = "pending"
    detail: str = ""
    restarts: int = 0
    num_failures: int = 0
    started_at: float | None = None
    last_exit_code: int | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def last_output(self, max_bytes: int = 4096) -> str:
        """The last non-empty line the child wrote to its log, for error messages."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
                lines = log.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return next((line.strip() for line in reversed(lines) if line.strip()), "")

    @property
    def uptime_s(self) -> float | None:
        if not self.alive or self.started_at is None:
            return None
        return time.monotonic() - self.started_at


def signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group led by `pid`; False when no such group remains."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def describe_exit(code: int) -> str:
    """`0` -> "exit 0", `-9` -> "killed by SIGKILL" (asyncio's negative signal codes)."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


class Supervisor:
    """Keeps every child running until `stop`; restarts with `Backoff` after a crash."""

    def __init__(
        self,
        specs: Iterable[ChildSpec],
        log_dir: Path,
        backoff: Backoff | None = None,
        on_spawn: Callable[[ChildState], None] | None = None,
        on_event: EventHandler | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children = {s.name: ChildState(s, log_dir / f"{s.name}.log") for s in specs}
        self.backoff = backoff or Backoff()
        self._on_spawn = on_spawn
        self._on_event = on_event
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._task_of: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Spawn every child once and keep them running in background tasks."""
        for child in self.children.values():
            await self._spawn(child)
            task = asyncio.create_task(self._keep_running(child))
            self._tasks.append(task)
            self._task_of[child.spec.name] = task

    async def stop(
        self, grace_s: float = 15.0, first: Sequence[str] = (), finishing: Sequence[str] = ()
    ) -> None:
        """SIGTERM the `first` children and wait for them, then every other child's group;
        SIGKILL what is left `grace_s` after the last SIGTERM. Stopping the producers of work first
        (the rollout-worker) lets their in-flight work finish against services still up; a
        slow first stop leaves the others their whole grace (the trainer its checkpoint).

        `finishing` children are ending on their own (the trainer at its step bound): they
        get until halfway to the deadline before their SIGTERM. A signal would cut short
        their own clean end: a torchrun agent SIGTERMed exits 1 even when its ranks finish."""
        self._stopping.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        early = [name for name in first if name in self.children]
        for name in early:
            self._terminate(self.children[name])
        early_tasks = [self._task_of[name] for name in early if name in self._task_of]
        if early_tasks:
            await asyncio.wait(early_tasks, timeout=grace_s)
            deadline = loop.time() + grace_s
        waiting = [name for name in finishing if name in self.children and name not in early]
        for name, child in self.children.items():
            if name not in early and name not in waiting:
                self._terminate(child)
        waiting_tasks = [self._task_of[name] for name in waiting if name in self._task_of]
        if waiting_tasks:
            await asyncio.wait(waiting_tasks, timeout=max(0.0, deadline - loop.time()) / 2)
        for name in waiting:
            self._terminate(self.children[name])
        if not self._tasks:
            return
        remaining_s = max(0.0, deadline - loop.time())
        _, pending = await asyncio.wait(self._tasks, timeout=remaining_s)
        if pending:
            self.kill_all()
        await asyncio.gather(*self._tasks)

    def kill_all(self) -> None:
        """SIGKILL every live child's group now (a second Ctrl-C)."""
        self._stopping.set()
        for child in self.children.values():
            if child.alive and child.pid is not None:
                child.state, child.detail = "killing", "SIGKILL"
                signal_group(child.pid, signal.SIGKILL)

    def all_pids(self) -> dict[str, list[int]]:
        """Every pid each child has had, oldest first."""
        return {name: list(child.pids) for name, child in self.children.items()}

    async def _keep_running(self, child: ChildState) -> None:
        while True:
            reason = await self._wait_exit(child)
            if self._stopping.is_set():
                return
            delay_s = self._next_delay_s(child)
            child.state, child.detail = "backoff", f"{reason}; restart in {delay_s:.1f} s"
            self._event("child exited", child=child.name, reason=reason, restart_in_s=delay_s)
            if await self._stop_requested_within(delay_s):
                # Down when the stop came: a service that ended with exit 0 finished its work
                # (the trainer at its step bound), any other exit is a crash.
                finished = child.last_exit_code == 0
                child.state, child.detail = "exited" if finished else "crashed", reason
                return
            child.restarts += 1
            await self._respawn(child)

    async def _wait_exit(self, child: ChildState) -> str:
        """Why the child is not running: its exit once it ends, or why it failed to start."""
        if not child.alive:
            return child.detail
        assert child.process is not None
        code = await child.process.wait()
        self._record_exit(child, code)
        return describe_exit(code)

    async def _respawn(self, child: ChildState) -> None:
        try:
            await self._spawn(child)
        except OSError as exc:
            child.state, child.detail = "failed", f"cannot start: {exc}"
            child.process, child.started_at = None, None

    async def _spawn(self, child: ChildState) -> None:
        with open(child.log_path, "ab") as log:
            log.write(f"\n=== launcher: start #{child.restarts + 1} at {time.ctime()}\n".encode())
            log.flush()
            child.process = await asyncio.create_subprocess_exec(
                *child.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **child.spec.env},
                start_new_session=True,
                # SIGTERM when the launcher dies, however it dies (a SIGKILL, a full disk):
                # no service outlives a launcher that cannot stop it.
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()),
            )
        child.pids.append(child.process.pid)
        child.state, child.detail = "running", ""
        child.started_at = time.monotonic()
        if self._on_spawn:
            self._on_spawn(child)
        if self._stopping.is_set():
            self._terminate(child)

    def _terminate(self, child: ChildState) -> None:
        if child.alive and child.pid is not None:
            child.state, child.detail = "stopping", "SIGTERM sent"
            signal_group(child.pid, signal.SIGTERM)

    def _record_exit(self, child: ChildState, code: int) -> None:
        child.last_exit_code = code
        if child.pid is not None:
            # The child may leave helpers behind in its group: none survive their leader.
            signal_group(child.pid, signal.SIGKILL)
        if not self._stopping.is_set():
            return
        child.state = "stopped" if code == 0 else "killed" if code == -signal.SIGKILL else "exited"
        child.detail = describe_exit(code)

    def _next_delay_s(self, child: ChildState) -> float:
        started = child.started_at or time.monotonic()
        if time.monotonic() - started >= self.backoff.reset_after_s:
            child.num_failures = 0
        child.num_failures += 1
        return self.backoff.delay_s(child.num_failures)

    async def _stop_requested_within(self, delay_s: float) -> bool:
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=delay_s)
        except TimeoutError:
            return False
        return True

    def _event(self, event: str, **fields: Any) -> None:
        if self._on_event:
            self._on_event(event, **fields)
