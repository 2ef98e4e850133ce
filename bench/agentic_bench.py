"""Benchmark agentic episodes: env step latency through the bus, and reward throughput.

- step latency: an EnvClient talks to env-gateway's EnvServer over a real nats-server
  (request/reply): `calc` tool steps (one `add` call), `coding` tool steps (`read_file`, and
  `run_python`, which runs in the episode's bubblewrap sandbox), the coding env's reset
  (sandbox seeded) and its grading step (hidden tests in a fresh sandbox);
- reward throughput: the reward service scores `calc` and `coding` rollouts from the raw
  stream into the scored stream; episodes/s from the first publish to the last scored.

    .venv/bin/python bench/agentic_bench.py [--steps 300] [--rollouts 2000]

Writes bench/results/<machine>/agentic.json and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from result_file import result_file, result_json

from libs.bus.connection import connect_bus
from libs.bus.provision import provision
from libs.bus.publisher import Outgoing, Publisher
from libs.domains.registry import make_env
from libs.envs.client import EnvClient
from libs.envs.server import EnvServer, ServerLimits
from libs.nats_server import NatsServer
from proto import messages as m
from proto import streams, subjects
from services.reward.service import RewardService
from services.reward.settings import RewardSettings

RESULTS = result_file("agentic")


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


async def timed(samples: list[float], call: Callable[[], Awaitable[Any]]) -> Any:
    started = time.perf_counter()
    result = await call()
    samples.append(time.perf_counter() - started)
    return result


def calc_call(call_id: str) -> m.ToolCall:
    return m.ToolCall(call_id=call_id, name="add", arguments={"a": 2, "b": 3})


async def calc_latency(client: EnvClient, steps: int) -> dict[str, Any]:
    task = make_env("calc").task_source(difficulty=2, group_size=1, seed=0).task(0)
    opening = await client.reset(task)
    samples: list[float] = []
    for index in range(steps):
        calls = [calc_call(f"c-{index}")]
        reply = await timed(
            samples,
            lambda c=calls: client.step(  # type: ignore[misc]
                opening.episode_id, "calc", "", tool_calls=c
            ),
        )
        assert not reply.done and not reply.tool_results[0].error, reply
    await client.close(opening.episode_id, "calc")
    return summary_ms(samples)


async def coding_latency(client: EnvClient, steps: int) -> dict[str, Any]:
    task = make_env("coding").task_source(difficulty=0, group_size=1, seed=0).task(0)
    resets: list[float] = []
    reads: list[float] = []
    runs: list[float] = []
    grades: list[float] = []
    episodes = max(3, steps // 20)
    for episode in range(episodes):
        opening = await timed(resets, lambda: client.reset(task))
        eid = opening.episode_id
        for index in range(steps // episodes):
            read = [m.ToolCall(call_id=f"r-{index}", name="list_files", arguments={})]
            reply = await timed(
                reads,
                lambda c=read, e=eid: client.step(  # type: ignore[misc]
                    e, "coding", "", tool_calls=c
                ),
            )
            assert not reply.tool_results[0].error, reply.tool_results
            if index % 5 == 0:
                code = [
                    m.ToolCall(
                        call_id=f"p-{index}",
                        name="run_python",
                        arguments={"code": "print(sum(range(1000)))"},
                    )
                ]
                reply = await timed(
                    runs,
                    lambda c=code, e=eid: client.step(  # type: ignore[misc]
                        e, "coding", "", tool_calls=c
                    ),
                )
                assert "499500" in reply.tool_results[0].content, reply.tool_results
        final = await timed(
            grades,
            lambda e=eid: client.step(e, "coding", "done", timeout_s=60),  # type: ignore[misc]
        )
        assert final.done and "tests_total" in final.info, (episode, final.info)
    return {
        "reset_with_sandbox": summary_ms(resets),
        "list_files_step": summary_ms(reads),
        "run_python_step": summary_ms(runs),
        "final_answer_with_grading": summary_ms(grades),
        "task": task.spec,
    }


def calc_rollout(index: int) -> m.Rollout:
    task = make_env("calc").task_source(difficulty=1, group_size=1, seed=1).task(index)
    answer = str(task.spec["answer"])
    turns = [
        m.Turn(role="user", token_ids=list(range(120)), text=task.prompt),
        m.Turn(
            role="assistant",
            token_ids=list(range(40)),
            text='<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            logprobs=[-0.5] * 40,
            policy_version=1,
        ),
        m.Turn(role="tool", token_ids=list(range(30)), text="<tool_result>5</tool_result>"),
        m.Turn(
            role="assistant",
            token_ids=list(range(4)),
            text=answer,
            logprobs=[-0.5] * 4,
            policy_version=1,
        ),
    ]
    return m.Rollout(
        rollout_id=f"bench-{index}",
        task_id=task.task_id,
        group_id=task.task_id,
        sample_index=0,
        env="calc",
        turns=turns,
        finish_reason="stop",
        task=task,
        env_info={"answer_correct": index % 2 == 0, "expected": task.spec["answer"]},
        stats={
            m.EPISODE_STAT_TURNS: 2,
            m.EPISODE_STAT_TOOL_CALLS: 1,
            m.EPISODE_STAT_INVALID_TOOL_CALLS: 0,
            m.EPISODE_STAT_GENERATED_TOKENS: 44,
        },
    )


async def reward_throughput(url: str, count: int) -> dict[str, Any]:
    bus = await connect_bus(url, name="bench-reward")
    service = RewardService(RewardSettings(fetch_timeout_s=0.2))
    await service.start(bus)
    running = asyncio.create_task(service.run())
    try:
        publisher = Publisher(bus.js)
        rollouts = [calc_rollout(i) for i in range(count)]
        started = time.perf_counter()
        await publisher.publish_many(
            [
                Outgoing(subjects.rollout_raw_subject("calc"), r, msg_id=r.rollout_id)
                for r in rollouts
            ]
        )
        published_s = time.perf_counter() - started
        deadline = started + 300
        while time.perf_counter() < deadline:
            info = await bus.js.stream_info(streams.ROLLOUTS_SCORED.name)
            if info.state.messages >= count:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
        scored = (await bus.js.stream_info(streams.ROLLOUTS_SCORED.name)).state.messages
    finally:
        await service.stop()
        await asyncio.wait_for(running, timeout=30)
        await bus.close()
    return {
        "rollouts": count,
        "scored": scored,
        "publish_s": round(published_s, 3),
        "elapsed_s": round(elapsed, 3),
        "episodes_per_s": round(scored / elapsed, 1),
        "rubric": "calc: exact_match, tool_calls, length, turns, env_ok (verifiable, no judge)",
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats")
        server.start()
        try:
            bus = await connect_bus(server.url, name="bench-agentic")
            await provision(bus.js)
            env_server = EnvServer(
                bus.nc,
                {"calc": make_env("calc"), "coding": make_env("coding")},
                ServerLimits(step_timeout_s=60),
            )
            await env_server.start()
            client_bus = await connect_bus(server.url, name="bench-agentic-client")
            client = EnvClient(client_bus.nc)
            try:
                calc = await calc_latency(client, args.steps)
                coding = await coding_latency(client, args.steps)
            finally:
                await env_server.stop()
                await client_bus.close()
                await bus.close()
            reward = await reward_throughput(server.url, args.rollouts)
        finally:
            server.stop()
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "notes": "client, env-gateway (in-process EnvServer), reward service and nats-server "
        "share the machine's cores; latency is one request/reply round trip incl. the tool",
        "calc_tool_step": calc,
        "coding": coding,
        "reward": reward,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rollouts", type=int, default=2000)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(result_json(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
