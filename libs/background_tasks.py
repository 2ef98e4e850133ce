"""The tasks a service runs beside its work, supervised: one that fails takes the service down.

    async with BackgroundTasks(stop=self._stopping) as tasks:
        tasks.start("generation-batcher", self.batcher.run())
        tasks.adopt(server_task, may_end=True)     # a task started elsewhere
        await tasks.until(self.follower.wait_caught_up())
        await tasks.until()                        # until `stop` is set

`until` waits for its goal (re-raising what the goal raises) or for `stop`, whichever comes
first; a task that raises, or ends while it should not (before `stop` is set, unless it may
end), makes it raise TaskDied, naming the task, from its error. The service's `run` then
raises and its process exits non-zero (libs/service.py): loudly, never silently. Leaving the
block cancels the tasks still running and waits for them; `join` instead waits for tasks
that end on their own once stopped (their owners drain them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from types import TracebackType
from typing import Any


class TaskDied(RuntimeError):
    """A supervised task raised, or ended when it should not have."""


class BackgroundTasks:
    """Named tasks run until `stop` is set (never, without one); see the module docstring."""

    def __init__(self, stop: asyncio.Event | None = None) -> None:
        self._stop = stop or asyncio.Event()
        # Each running task -> whether it may end cleanly before `stop` is set.
        self._tasks: dict[asyncio.Task[Any], bool] = {}

    def start(
        self, name: str, work: Coroutine[Any, Any, Any], *, may_end: bool = False
    ) -> asyncio.Task[Any]:
        """Run `work` as the task `name`."""
        return self.adopt(asyncio.create_task(work, name=name), may_end=may_end)

    def adopt(self, task: asyncio.Task[Any], *, may_end: bool = False) -> asyncio.Task[Any]:
        """Supervise `task`, started elsewhere (its name is the one reported)."""
        self._tasks[task] = may_end
        return task

    async def until(self, goal: Awaitable[Any] | None = None) -> None:
        """Wait for `goal` (without one: for `stop`) or `stop`; TaskDied first if a task fails."""
        waiting = {asyncio.ensure_future(self._stop.wait())}
        goal_done = asyncio.ensure_future(goal) if goal is not None else None
        if goal_done is not None:
            waiting.add(goal_done)
        try:
            while True:
                self._raise_for_ended()
                if goal_done is not None and goal_done.done():
                    goal_done.result()  # raises what the goal raised
                    return
                if self._stop.is_set():
                    return
                await asyncio.wait(waiting | set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in waiting:
                future.cancel()

    def _raise_for_ended(self) -> None:
        for task in [task for task in self._tasks if task.done()]:
            may_end = self._tasks.pop(task) or self._stop.is_set()
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise TaskDied(f"{task.get_name()} failed: {error!r}") from error
            if not may_end:
                raise TaskDied(f"{task.get_name()} stopped unexpectedly")

    async def join(self) -> None:
        """Wait for the tasks to end on their own (once `stop` is set, as their owners drain
        them); TaskDied if one failed."""
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._raise_for_ended()

    async def close(self) -> None:
        """Cancel the tasks still running and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def __aenter__(self) -> BackgroundTasks:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
