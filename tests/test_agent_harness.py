"""The multi-turn harness (libs/rollout/agent.py) against a real env server on a real nats-server.

Most tests drive the harness with a scripted policy (it writes chosen texts, so tool calls are
exercised deterministically); the last one runs the real tiny engine through the batcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

import pytest

from libs.bus.connection import Bus
from libs.chat.tool_calls import format_tool_call
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.envs.base import Environment, Episode, Opening, StepResult
from libs.envs.client import EnvClient
from libs.envs.server import EnvServer, ServerLimits
from libs.policy import PolicyConfig, build_policy
from libs.rl import build_batch
from libs.rollout.agent import SUMMARY_REQUEST, AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import RunnerSettings
from libs.tokenizer import ByteTokenizer
from proto import messages as m
from proto.messages import ChatMessage, ScoredRollout, Task, ToolCall, ToolResult, ToolSpec

TOKENIZER = ByteTokenizer()
POLICY_VERSION = 7


class AdderEpisode(Episode):
    """Tool `add(x)` adds to a running total; the final answer is right when it names it."""

    def __init__(self) -> None:
        self.total = 0

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        if not tool_calls:
            return StepResult(done=True, info={"answer_correct": str(self.total) in action})
        results = []
        for call in tool_calls:
            if call.name == "boom":
                raise RuntimeError("the adder broke")
            x = call.arguments.get("x")
            if not isinstance(x, int):
                results.append(
                    ToolResult(
                        call_id=call.call_id,
                        name=call.name,
                        content="x must be an int",
                        error=m.TOOL_ERROR_BAD_ARGUMENTS,
                    )
                )
                continue
            self.total += x
            results.append(
                ToolResult(call_id=call.call_id, name=call.name, content=str(self.total))
            )
        return StepResult(tool_results=tuple(results))


class AdderEnv(Environment):
    name: ClassVar[str] = "adder"
    max_turns: ClassVar[int] = 8

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        tools = (
            ToolSpec(name="add", description="Adds x to the total.", parameters={"x": "int"}),
            ToolSpec(name="boom", description="Breaks the environment."),
        )
        messages = (ChatMessage(role="user", content=task.prompt),)
        return AdderEpisode(), Opening(
            messages=messages, tools=tools, max_turns=self.max_turns, max_tokens=64
        )


class ScriptedPolicy:
    """Writes the given texts turn after turn (a summary when asked for one); records prompts."""

    def __init__(self, turns: Sequence[str], summary: str = "I added 2 so far.") -> None:
        self.turns = list(turns)
        self.summary = summary
        self.prompts: list[list[int]] = []
        self.completions: list[Completion] = []

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        (prompt,) = prompts
        self.prompts.append(list(prompt))
        asked_summary = SUMMARY_REQUEST in TOKENIZER.decode(prompt[-400:])
        text = self.summary if asked_summary else self.turns.pop(0)
        ids = [*TOKENIZER.encode(text), TOKENIZER.eos_id]
        completion = Completion(
            0, 0, ids, [-0.5] * len(ids), [-0.6] * len(ids), "stop", POLICY_VERSION
        )
        self.completions.append(completion)
        return [completion]


def adder_task(task_id: str = "t1", group_size: int = 1) -> Task:
    return Task(
        task_id=task_id,
        env="adder",
        prompt="Add 2 to the total, then say it.",
        group_size=group_size,
    )


@pytest.fixture
async def env_server(bus: Bus) -> AsyncIterator[EnvServer]:
    server = EnvServer(bus.nc, {"adder": AdderEnv()}, ServerLimits(step_timeout_s=5))
    await server.start()
    yield server
    await server.stop()


def runner(bus: Bus, policy: ScriptedPolicy, **agent: object) -> AgentRunner:
    return AgentRunner(
        EnvClient(bus.nc),
        TOKENIZER,
        policy.generate,
        RunnerSettings(worker_id="w-test"),
        AgentSettings(**agent),  # type: ignore[arg-type]
    )


def segment_ids(rollout: m.Rollout, segment: int) -> list[int]:
    return [i for turn in rollout.turns if turn.segment == segment for i in turn.token_ids]


async def test_tool_calls_invalid_calls_and_a_final_answer(bus: Bus, env_server: EnvServer) -> None:
    policy = ScriptedPolicy(
        [
            "Adding. " + format_tool_call("add", {"x": 2}),
            "<tool_call>{not json}</tool_call>" + format_tool_call("mul", {"x": 3}),
            "The total is 2.",
        ]
    )
    (rollout,) = await runner(bus, policy).run(adder_task())

    assert rollout.finish_reason == "stop" and rollout.env_info == {"answer_correct": True}
    assert rollout.stats[m.EPISODE_STAT_TURNS] == 3
    assert rollout.stats[m.EPISODE_STAT_TOOL_CALLS] == 1
    assert rollout.stats[m.EPISODE_STAT_INVALID_TOOL_CALLS] == 2
    assert [t.role for t in rollout.turns] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    first_result, invalid_results = rollout.turns[2].text, rollout.turns[4].text
    assert 'name="add">\n2\n</tool_result>' in first_result
    assert 'error="invalid_call"' in invalid_results and 'error="unknown_tool"' in invalid_results
    assert "unknown tool 'mul'" in invalid_results
    # Exactly the engine's tokens: each prompt is every turn before it, never re-tokenized.
    assistants = [t for t in rollout.turns if t.role == "assistant"]
    for index, (turn, completion) in enumerate(zip(assistants, policy.completions, strict=True)):
        assert turn.token_ids == completion.token_ids and turn.logprobs == completion.logprobs
        assert turn.policy_version == POLICY_VERSION
        position = rollout.turns.index(turn)
        before = [i for t in rollout.turns[:position] for i in t.token_ids]
        assert policy.prompts[index] == before
    assert rollout.env_error == "" and env_server.episodes == {}


async def test_tool_results_are_masked_out_of_the_loss(bus: Bus, env_server: EnvServer) -> None:
    policy = ScriptedPolicy([format_tool_call("add", {"x": 2}), "2"])
    (rollout,) = await runner(bus, policy).run(adder_task())
    batch = build_batch(
        [ScoredRollout(rollout=rollout, reward=1.0)], [0.5], pad_id=TOKENIZER.pad_id
    )
    generated = sum(len(t.token_ids) for t in rollout.turns if t.role == "assistant")
    assert batch.num_loss_tokens == generated
    assert batch.behavior_logprobs[batch.loss_mask].eq(-0.5).all()
    assert batch.token_versions[batch.loss_mask].eq(POLICY_VERSION).all()


async def test_max_turns_ends_and_closes_the_episode(bus: Bus, env_server: EnvServer) -> None:
    policy = ScriptedPolicy([format_tool_call("add", {"x": 1})] * 3)
    (rollout,) = await runner(bus, policy, max_turns=3).run(adder_task())
    assert rollout.finish_reason == "max_turns" and rollout.stats[m.EPISODE_STAT_TURNS] == 3
    assert env_server.episodes == {}


async def test_an_env_error_ends_the_episode_and_is_recorded(
    bus: Bus, env_server: EnvServer
) -> None:
    policy = ScriptedPolicy([format_tool_call("boom", {})])
    (rollout,) = await runner(bus, policy).run(adder_task())
    assert rollout.finish_reason == "env_error" and rollout.env_error == m.ENV_ERROR_ENV_CRASHED
    assert "the adder broke" in rollout.env_error_message
    # The gateway keeps serving.
    (after,) = await runner(bus, ScriptedPolicy(["0"])).run(adder_task("t2"))
    assert after.finish_reason == "stop"


async def test_a_self_summarizing_episode_yields_one_row_per_segment(
    bus: Bus, env_server: EnvServer
) -> None:
    call = "Next. " + format_tool_call("add", {"x": 1})
    policy = ScriptedPolicy([call] * 7 + ["The total is 7."], summary="Added 1 several times.")
    agent = runner(bus, policy, context_budget_tokens=1000, summary_max_tokens=64, max_turns=12)
    opening_length = len(
        agent.template.render(
            [ChatMessage(role="user", content=adder_task().prompt)],
            tools=[ToolSpec(name="add"), ToolSpec(name="boom")],
            add_generation_prompt=False,
        )
    )
    assert opening_length < 1000 < opening_length + 8 * 120, "the episode must pass the budget"

    (rollout,) = await agent.run(adder_task())

    assert rollout.finish_reason == "stop" and rollout.env_info == {"answer_correct": True}
    num_segments = int(rollout.stats[m.EPISODE_STAT_SEGMENTS])
    assert num_segments >= 2 and {t.segment for t in rollout.turns} == set(range(num_segments))
    for segment in range(num_segments):
        ids = segment_ids(rollout, segment)
        assert len(ids) <= 1000 + 64 + 100  # budget + the summary turn and its request
        assert any(t.role == "assistant" for t in rollout.turns if t.segment == segment)
    later = TOKENIZER.decode(segment_ids(rollout, 1))
    assert "Added 1 several times." in later and adder_task().prompt in later
    batch = build_batch(
        [ScoredRollout(rollout=rollout, reward=1.0)], [0.25], pad_id=TOKENIZER.pad_id
    )
    assert batch.num_rows == num_segments and batch.advantages.eq(0.25).all()
    assert batch.sample_ids == [rollout.rollout_id] * num_segments


async def test_a_real_engine_episode_keeps_engine_tokens_and_versions(
    bus: Bus, env_server: EnvServer
) -> None:
    engine = HFEngine(build_policy(PolicyConfig(device="cpu", seed=3)), TOKENIZER)
    batcher = GenerationBatcher(engine)
    batcher.open.set()  # weights are loaded (the follower opens it in the worker)
    batcher_task = asyncio.create_task(batcher.run())
    seen: list[tuple[list[int], list[Completion]]] = []

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        completions = await batcher.generate(prompts, params)
        seen.append((prompts[0], completions))
        return completions

    try:
        agent = AgentRunner(
            EnvClient(bus.nc),
            TOKENIZER,
            generate,
            RunnerSettings(worker_id="w-real"),
            AgentSettings(max_turns=3),
        )
        rollouts = await agent.run(adder_task(group_size=2))
    finally:
        batcher_task.cancel()
    assert len(rollouts) == 2 and all(r.finish_reason in ("stop", "max_turns") for r in rollouts)
    for prompt, (completion,) in seen:
        rollout = next(
            r
            for r in rollouts
            if any(t.token_ids == completion.token_ids and t.role == "assistant" for t in r.turns)
        )
        turn = next(t for t in rollout.turns if t.token_ids == completion.token_ids)
        assert turn.logprobs == completion.logprobs and turn.policy_version == engine.policy_version
        position = rollout.turns.index(turn)
        assert prompt == [i for t in rollout.turns[:position] for i in t.token_ids]
