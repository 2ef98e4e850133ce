"""An environment in another process, written without rlpipe code (examples/external_env.py),
driven by the multi-turn harness over a real nats-server: the wire protocol is enough."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from libs.bus.connection import Bus
from libs.chat.tool_calls import format_tool_call
from libs.engine.base import Completion, SamplingParams
from libs.envs.client import EnvClient
from libs.nats_server import NatsServer
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.episode import RunnerSettings
from libs.tokenizer import ByteTokenizer
from proto import messages as m
from proto.messages import Task
from tests.conftest import wait_for

TOKENIZER = ByteTokenizer()
EXAMPLE = Path(__file__).parent.parent / "examples" / "external_env.py"


@pytest.fixture
def external_env(nats_server: NatsServer) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), nats_server.url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert "serving env 'notes'" in process.stdout.readline()  # subscribed: ready
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)


class Script:
    """Writes the given turns; records nothing else (the policy is not what is tested)."""

    def __init__(self, turns: Sequence[str]) -> None:
        self.turns = list(turns)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        ids = [*TOKENIZER.encode(self.turns.pop(0)), TOKENIZER.eos_id]
        return [Completion(0, 0, ids, [-1.0] * len(ids), [-1.0] * len(ids), "stop", 1)]


async def test_the_harness_runs_an_episode_of_an_external_process_env(
    bus: Bus, external_env: subprocess.Popen[str]
) -> None:
    script = Script(
        [
            format_tool_call("add_note", {"text": "buy milk"}),
            format_tool_call("add_note", {"text": 42})
            + format_tool_call("add_note", {"text": "x"}),
            "I took two notes.",
        ]
    )
    runner = AgentRunner(
        EnvClient(bus.nc),
        TOKENIZER,
        script.generate,
        RunnerSettings(worker_id="w"),
        AgentSettings(max_turns=8),
    )
    task = Task(task_id="notes-1", env="notes", prompt="Take some notes.")

    (rollout,) = await runner.run(task)

    assert rollout.finish_reason == "stop"
    assert rollout.env_info == {"num_notes": 2, "answer": "I took two notes."}
    assert rollout.stats[m.EPISODE_STAT_TOOL_CALLS] == 3
    assert rollout.stats[m.EPISODE_STAT_TOOL_ERRORS] == 1  # the non-string text
    tool_turns = [t.text for t in rollout.turns if t.role == "tool"]
    assert "1 notes" in tool_turns[0] and 'error="bad_arguments"' in tool_turns[1]
    assert "2 notes" in tool_turns[1]


async def test_its_errors_are_typed_replies(bus: Bus, external_env: subprocess.Popen[str]) -> None:
    client = EnvClient(bus.nc)
    with pytest.raises(Exception) as raised:
        await client.step("never-opened", "notes", "hello")
    assert getattr(raised.value, "kind", "") == m.ENV_ERROR_UNKNOWN_EPISODE
    opening = await client.reset(Task(task_id="t", env="notes", prompt="p"), episode_id="e1")
    assert [t.name for t in opening.tools] == ["add_note"] and opening.max_turns == 4
    assert await client.close("e1", "notes") is True
    await wait_for(lambda: external_env.poll() is None, what="the env process still up")
