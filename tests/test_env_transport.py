"""An env client reads the same through either transport: over the bus to an EnvServer, and
in this process to the same handler (LocalEnvClient), errors and timeouts included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, ClassVar

import pytest

from libs.bus.connection import Bus
from libs.envs.base import Environment, Episode, Opening, StepResult
from libs.envs.client import EnvClient, EnvError
from libs.envs.local_client import LocalEnvClient
from libs.envs.server import EnvServer, ServerLimits
from proto import messages as m
from proto.messages import Task, ToolCall
from tests.conftest import wait_for

LIMITS = ServerLimits(step_timeout_s=30)


class CountingEpisode(Episode):
    """ "ok" continues, "end" finishes, "boom" raises, "wait" waits for `released`."""

    released: ClassVar[asyncio.Event]

    def __init__(self) -> None:
        self.turns = 0

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        self.turns += 1
        if action == "boom":
            raise RuntimeError("the tool crashed")
        if action == "wait":
            await CountingEpisode.released.wait()
        return StepResult(observation=f"turn {self.turns}: {action}", done=action == "end")


class CountingEnv(Environment):
    name: ClassVar[str] = "counting"

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        return CountingEpisode(), Opening(observation=f"count {task.prompt}", max_tokens=7)


def task(task_id: str, env: str = CountingEnv.name) -> Task:
    return Task(task_id=task_id, env=env, prompt="to three")


@pytest.fixture
async def clients(bus: Bus) -> AsyncIterator[dict[str, EnvClient]]:
    """The same env behind both transports: "bus" (an EnvServer on nats) and "local"."""
    server = EnvServer(bus.nc, {CountingEnv.name: CountingEnv()}, LIMITS)
    await server.start()
    yield {"bus": EnvClient(bus.nc), "local": LocalEnvClient({CountingEnv.name: CountingEnv()})}
    await server.stop()


async def episode_replies(client: EnvClient, episode_id: str) -> list[tuple[object, ...]]:
    opening = await client.reset(task("t-1"), episode_id=episode_id)
    replies: list[tuple[object, ...]] = [(opening.observation, opening.max_tokens)]
    for action in ("ok", "end"):
        reply = await client.step(episode_id, CountingEnv.name, action)
        replies.append((reply.observation, reply.done))
    return replies


async def failures(client: EnvClient, episode_id: str) -> list[str]:
    """The error kinds of: an env nobody serves, a step that raises, a step after the end."""
    kinds = []
    for attempt in (
        client.reset(task("t-2", env="nobody-serves-this"), timeout_s=5),
        client.reset(task("t-3"), episode_id=episode_id),
        client.step(episode_id, CountingEnv.name, "boom"),
        client.step(episode_id, CountingEnv.name, "ok"),
    ):
        try:
            await attempt
        except EnvError as exc:
            kinds.append(exc.kind)
    return kinds


EPISODE = [("count to three", 7), ("turn 1: ok", False), ("turn 2: end", True)]
FAILURES = [m.ENV_ERROR_UNKNOWN_ENV, m.ENV_ERROR_ENV_CRASHED, m.ENV_ERROR_UNKNOWN_EPISODE]


@pytest.mark.parametrize(
    "conversation, expected",
    [(episode_replies, EPISODE), (failures, FAILURES)],
    ids=["an episode", "its failures"],
)
async def test_the_transports_answer_alike(
    clients: dict[str, EnvClient],
    conversation: Callable[..., Awaitable[list[Any]]],
    expected: list[Any],
) -> None:
    """An episode's replies, and the kinds of its failures, are the same over the bus and
    in process; neither client is left holding an episode."""
    over_bus = await conversation(clients["bus"], "ep-bus")
    in_process = await conversation(clients["local"], "ep-local")

    assert over_bus == in_process == expected
    assert clients["bus"].num_open == clients["local"].num_open == 0


async def test_an_in_process_request_times_out_while_the_handler_finishes_it() -> None:
    """As on the bus: the caller stops waiting, the gateway's step still runs to its end."""
    CountingEpisode.released = asyncio.Event()
    client = LocalEnvClient({CountingEnv.name: CountingEnv()}, LIMITS)
    await client.reset(task("t-4"), episode_id="ep-slow")

    with pytest.raises(EnvError) as raised:
        await client.step("ep-slow", CountingEnv.name, "wait", timeout_s=0.05)
    held = client.handler.episodes["ep-slow"]
    assert raised.value.kind == m.ENV_ERROR_TIMEOUT and held.busy.locked()

    CountingEpisode.released.set()
    await wait_for(lambda: not held.busy.locked(), timeout_s=30, what="the step to finish")
    assert isinstance(held.episode, CountingEpisode) and held.episode.turns == 1
