"""Tool-call latency: environments whose tools take a while, drawn from a heavy-tailed law.

Real agent tools (a build, a test run, a web request) take seconds, unevenly: most calls are
quick and a few take ten times the median or more. That is what makes synchronous RL wait on
stragglers and pipelined RL win, so benchmarks need it. `with_tool_latency(env, latency)`
wraps any environment: each step that carries tool calls sleeps one draw per call first.

    latency = parse_tool_latency("lognormal:median_s=0.5,sigma=1.2,max_s=20")
    env = with_tool_latency(make_env("calc"), latency, seed=0)

Specs (env-gateway's `tool_latency` setting): `none`; `constant:seconds=S`;
`lognormal:median_s=M,sigma=S,max_s=X` (defaults M=0.5, S=1.2, X=20: the p90 is 2.3x the
median, the p99 8x, one call in 200 about 10x, capped at X so a step stays under the
gateway's step timeout).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from libs.envs.base import Environment, Episode, Opening, StepResult, TaskSource
from proto.messages import Task, ToolCall

LatencyKind = Literal["none", "constant", "lognormal"]
_DEFAULTS: dict[str, dict[str, float]] = {
    "none": {},
    "constant": {"seconds": 0.5},
    "lognormal": {"median_s": 0.5, "sigma": 1.2, "max_s": 20.0},
}


@dataclass(frozen=True)
class ToolLatency:
    """A latency law for tool calls; `draw` gives one call's seconds."""

    kind: LatencyKind = "none"
    median_s: float = 0.5  # lognormal: exp(mu); constant: the seconds
    sigma: float = 1.2
    max_s: float = 20.0

    def draw(self, rng: random.Random) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "constant":
            return self.median_s
        return min(self.max_s, rng.lognormvariate(math.log(self.median_s), self.sigma))


def parse_tool_latency(spec: str) -> ToolLatency:
    """`none`, `constant:seconds=S` or `lognormal:median_s=M,sigma=S,max_s=X` (ValueError
    naming the problem otherwise)."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in _DEFAULTS:
        raise ValueError(f"tool_latency {spec!r}: kind must be one of {', '.join(_DEFAULTS)}")
    values = dict(_DEFAULTS[kind])
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, number = item.partition("=")
        if key not in values:
            raise ValueError(
                f"tool_latency {spec!r}: {kind} takes {', '.join(values) or 'nothing'}"
            )
        try:
            values[key] = float(number)
        except ValueError:
            raise ValueError(f"tool_latency {spec!r}: {key} must be a number") from None
        if values[key] < 0:
            raise ValueError(f"tool_latency {spec!r}: {key} must be >= 0")
    if kind == "constant":
        return ToolLatency("constant", median_s=values["seconds"])
    if kind == "lognormal":
        if values["median_s"] <= 0:
            raise ValueError(f"tool_latency {spec!r}: median_s must be > 0")
        return ToolLatency("lognormal", values["median_s"], values["sigma"], values["max_s"])
    return ToolLatency()


class LatencyEpisode(Episode):
    """An episode whose tool-carrying steps first sleep one latency draw per call."""

    def __init__(self, inner: Episode, latency: ToolLatency, rng: random.Random) -> None:
        self.inner, self.latency, self.rng = inner, latency, rng

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        delay_s = sum(self.latency.draw(self.rng) for _ in tool_calls)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return await self.inner.step(action, tool_calls)

    async def close(self) -> None:
        await self.inner.close()


class LatencyEnv(Environment):
    """`inner` with slow tools; same name, tasks and openings."""

    def __init__(self, inner: Environment, latency: ToolLatency, seed: int = 0) -> None:
        self.inner, self.latency = inner, latency
        self.name = inner.name  # type: ignore[misc]  # the wrapped env's name, per instance
        self.rng = random.Random(f"latency:{inner.name}:{seed}")

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        episode, opening = await self.inner.reset(task)
        return LatencyEpisode(episode, self.latency, self.rng), opening

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return self.inner.task_source(difficulty=difficulty, group_size=group_size, seed=seed)


def with_tool_latency(env: Environment, latency: ToolLatency, seed: int = 0) -> Environment:
    """`env` itself when there is no latency, else wrapped."""
    return env if latency.kind == "none" else LatencyEnv(env, latency, seed)
