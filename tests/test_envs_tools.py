"""The calc environment: multi-step tasks, tool calls, answers and bad calls, in-process and
through a real env-gateway on a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.domains.calc.env import CalcEnv, CalcTasks, parse_answer
from libs.domains.registry import make_env
from libs.envs.client import EnvClient
from libs.envs.feeder import FeederConfig
from proto import messages as m
from proto.messages import Task, ToolCall
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(call_id=f"c-{name}", name=name, arguments=dict(arguments))


def test_tasks_are_deterministic_by_index_and_multi_step() -> None:
    source = CalcTasks(difficulty=3, group_size=4, seed=7)
    first, again = source.task(5), CalcTasks(difficulty=3, group_size=4, seed=7).task(5)
    assert first == again and first.env == "calc" and first.group_size == 4
    assert source.task(6).prompt != first.prompt
    assert first.prompt.count("(") == 3 and isinstance(first.spec["answer"], int)
    assert make_env("calc").task_source(difficulty=0, group_size=1, seed=0).task(0).env == "calc"
    with pytest.raises(ValueError, match="difficulty"):
        CalcTasks(difficulty=99, group_size=1, seed=0)


async def test_tool_calls_then_the_right_answer() -> None:
    task = Task(task_id="t", env="calc", prompt="What is (12 + 7) * 3?", spec={"answer": 57})
    episode, opening = await CalcEnv().reset(task)
    assert [t.name for t in opening.tools] == ["add", "subtract", "multiply", "divide"]
    assert opening.messages[-1].content == task.prompt and opening.max_turns >= 3
    first = await episode.step("", [call("add", a=12, b=7)])
    assert not first.done and [r.content for r in first.tool_results] == ["19"]
    second = await episode.step("", [call("multiply", a=19, b=3), call("divide", a=57, b=3)])
    assert [(r.content, r.error) for r in second.tool_results] == [("57", ""), ("19", "")]
    assert [r.call_id for r in second.tool_results] == ["c-multiply", "c-divide"]
    final = await episode.step("The answer is 57.")
    assert final.done
    assert final.info == {
        "answer_correct": True,
        "expected": 57,
        "answer": "57",
        "num_tool_calls": 3,
    }


async def test_a_wrong_answer_and_no_answer() -> None:
    task = Task(task_id="t", env="calc", prompt="What is 2 + 2?", spec={"answer": 4})
    episode, _ = await CalcEnv().reset(task)
    wrong = await episode.step("It is 5")
    assert wrong.done and wrong.info["answer_correct"] is False and wrong.info["expected"] == 4
    episode, _ = await CalcEnv().reset(task)
    assert (await episode.step("no idea")).info["answer"] == ""
    assert parse_answer("so -1,234 it is") == "-1234"


async def test_bad_arguments_and_unknown_tools_are_tool_errors_not_exceptions() -> None:
    task = CalcTasks(difficulty=0, group_size=1, seed=0).task(0)
    episode, _ = await CalcEnv().reset(task)
    calls = [
        call("add", a=1),
        call("add", a="1", b=2),
        call("add", a=True, b=2),
        call("add", a=1, b=2, c=3),
        call("multiply", a=10**18, b=10**18),
        call("divide", a=1, b=0),
        call("divide", a=7, b=2),
        call("sqrt", a=4),
        call("subtract", a=-3, b=4),
    ]
    result = await episode.step("", calls)
    errors = [r.error for r in result.tool_results]
    assert errors == [
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_FAILED,
        m.TOOL_ERROR_FAILED,
        m.TOOL_ERROR_FAILED,
        m.TOOL_ERROR_UNKNOWN_TOOL,
        "",
    ]
    assert result.tool_results[-1].content == "-7" and not result.done
    assert "division by zero" in result.tool_results[5].content
    assert (await episode.step(str(task.spec["answer"]))).info["answer_correct"] is True


async def test_a_task_without_an_integer_answer_is_refused() -> None:
    with pytest.raises(ValueError, match="integer answer"):
        await CalcEnv().reset(Task(task_id="bad", env="calc", prompt="?", spec={"answer": "4"}))


async def test_a_calc_episode_through_env_gateway(bus: Bus) -> None:
    await provision(bus.js)
    service = EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off")))
    await service.start(bus)
    running = asyncio.create_task(service.run())
    try:
        client = EnvClient(bus.nc)
        task = CalcTasks(difficulty=1, group_size=1, seed=0).task(0)
        opening = await client.reset(task, episode_id="calc-1")
        assert [t.name for t in opening.tools] == ["add", "subtract", "multiply", "divide"]
        assert opening.messages[-1].content == task.prompt and opening.max_turns > 0
        reply = await client.step(
            "calc-1", "calc", "", tool_calls=[call("add", a=2, b=3), call("pow", a=2)]
        )
        first = reply.tool_results[0]
        assert (first.content, first.error) == ("5", "")
        assert reply.tool_results[1].error == m.TOOL_ERROR_UNKNOWN_TOOL and not reply.done
        final = await client.step("calc-1", "calc", f"It is {task.spec['answer']}.")
        assert final.done and final.info["answer_correct"] is True
        assert service.health()["episodes_open"] == 0
    finally:
        await service.stop()
        await asyncio.wait_for(running, timeout=10)
