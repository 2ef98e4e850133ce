"""A service's background tasks (libs/background_tasks.py): one that dies takes the service
down, naming it; stopping ends the wait; leaving the block leaves no task running."""

from __future__ import annotations

import asyncio

import pytest

from libs.background_tasks import BackgroundTasks, TaskDied


async def forever() -> None:
    await asyncio.Event().wait()


async def crash_after(gate: asyncio.Event) -> None:
    await gate.wait()
    raise ValueError("the loop broke")


async def test_a_task_that_raises_takes_the_wait_down_naming_it_and_the_rest_stop() -> None:
    gate = asyncio.Event()
    async with BackgroundTasks() as tasks:
        bystander = tasks.start("bystander", forever())
        tasks.start("crasher", crash_after(gate))
        gate.set()
        with pytest.raises(TaskDied, match="crasher failed") as raised:
            await tasks.until(forever())
    assert isinstance(raised.value.__cause__, ValueError)
    assert bystander.cancelled()


async def test_a_task_that_ends_before_stop_is_a_failure_unless_it_may_end() -> None:
    stop = asyncio.Event()
    async with BackgroundTasks(stop=stop) as tasks:
        tasks.start("finishes", asyncio.sleep(0), may_end=True)
        tasks.start("quits", asyncio.sleep(0))
        with pytest.raises(TaskDied, match="quits stopped unexpectedly"):
            await tasks.until()


async def test_the_goal_decides_unless_stop_comes_first() -> None:
    stop = asyncio.Event()
    async with BackgroundTasks(stop=stop) as tasks:
        tasks.start("loop", forever())
        done = asyncio.Event()

        async def goal() -> None:
            done.set()

        await tasks.until(goal())
        assert done.is_set()

        async def failing_goal() -> None:
            raise LookupError("not our policy")

        with pytest.raises(LookupError, match="not our policy"):
            await tasks.until(failing_goal())

        never = asyncio.ensure_future(forever())
        asyncio.get_running_loop().call_soon(stop.set)
        await tasks.until(never)  # returns on stop, the goal given up
        await asyncio.sleep(0)
        assert never.cancelled()


async def test_join_lets_the_tasks_finish_their_drain_after_stop() -> None:
    stop = asyncio.Event()
    drained: list[str] = []

    async def drains_on_stop(name: str) -> None:
        await stop.wait()
        await asyncio.sleep(0)
        drained.append(name)

    async with BackgroundTasks(stop=stop) as tasks:
        first, second = (
            tasks.start("api", drains_on_stop("api")),
            tasks.start("join", drains_on_stop("join")),
        )
        asyncio.get_running_loop().call_soon(stop.set)
        await tasks.until()
        await tasks.join()
    assert sorted(drained) == ["api", "join"] and first.done() and second.done()
    assert not first.cancelled() and not second.cancelled()
