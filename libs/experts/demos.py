"""Demonstration files: a domain's scripted expert's episodes through its real environment,
under its harness limits, as JSONL.

    rlpipe domain demos --env calc --num-tasks 400 --error-rate 0.1 --out calc.jsonl

or from code: `stats = asyncio.run(write_demonstrations(DemoConfig(env="calc", ...), path))`.
Each line is one context segment (libs.sft.transcript), ready for `rlpipe sft`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.chat.template import chat_template_for
from libs.domains.registry import domain, domains, make_env
from libs.experts.record import record_episode
from libs.sft.transcript import Transcript, render_transcript, transcript_to_json
from libs.tokenizer import load_tokenizer

# Episodes recorded for `demonstrations_digest` (milliseconds each).
DIGEST_TASKS = 8
# Episodes recorded at once: a sandboxed one (functions, coding) waits on its tool processes
# for most of its ~0.25 s, so one at a time left a 2-core machine mostly idle (8 at once:
# 0.1 s an episode there).
CONCURRENT_EPISODES = max(8, os.cpu_count() or 1)


def expert_domains() -> list[str]:
    """Names of the domains with a scripted expert, sorted."""
    return sorted(name for name, found in domains().items() if found.expert is not None)


@dataclass(frozen=True)
class DemoConfig:
    """Which demonstrations to make."""

    env: str = "calc"
    num_tasks: int = 400
    error_rate: float = 0.1
    difficulty: int = 0
    seed: int = 1234  # never the feeder's default seed (0): demonstrations are not RL tasks
    tokenizer: str = "byte"


@dataclass(frozen=True)
class DemoStats:
    """What a demonstration file holds."""

    episodes: int
    segments: int
    success_rate: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "segments": self.segments,
            "success_rate": self.success_rate,
        }


async def record_demonstrations(
    config: DemoConfig, num_tasks: int | None = None, concurrency: int = CONCURRENT_EPISODES
) -> AsyncIterator[tuple[list[Transcript], dict[str, Any]]]:
    """The expert's episodes of `config` (its first `num_tasks`, default all), in task order:
    each one's segments as transcripts and the env's final info. Up to `concurrency` run at
    once; each has a generator of its own, so the demonstrations are the same however many."""
    found = domain(config.env)
    if found.expert is None:
        raise ValueError(
            f"no scripted expert for env {config.env!r}; experts: {', '.join(expert_domains())}"
        )
    env = make_env(config.env)
    expert = found.expert(config.error_rate)
    template = chat_template_for(load_tokenizer(config.tokenizer))
    source = env.task_source(difficulty=config.difficulty, group_size=1, seed=config.seed)
    agent = found.harness(template)

    async def episode(index: int) -> tuple[list[Transcript], dict[str, Any]]:
        rng = random.Random(f"demo:{config.seed}:{index}")
        return await record_episode(env, source.task(index), expert, agent, template, rng)

    pending: deque[asyncio.Task[tuple[list[Transcript], dict[str, Any]]]] = deque()
    try:
        for index in range(config.num_tasks if num_tasks is None else num_tasks):
            pending.append(asyncio.create_task(episode(index)))
            if len(pending) >= max(1, concurrency):
                yield await pending.popleft()
        while pending:
            yield await pending.popleft()
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def write_demonstrations(config: DemoConfig, path: Path) -> DemoStats:
    """Record `config.num_tasks` expert episodes into `path` (JSONL, one segment per line)."""
    segments = successes = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        async for transcripts, info in record_demonstrations(config):
            successes += bool(info.get("answer_correct"))
            segments += len(transcripts)
            for transcript in transcripts:
                file.write(json.dumps(transcript_to_json(transcript)) + "\n")
    return DemoStats(config.num_tasks, segments, round(successes / max(config.num_tasks, 1), 4))


@functools.cache
def demonstrations_digest(config: DemoConfig) -> str:
    """A digest of what `config`'s demonstrations are: the token ids and loss masks of its
    first DIGEST_TASKS episodes as SFT renders them. It changes when the expert, the
    environment, the harness limits or the chat template change what is recorded (a cache
    keyed on the config alone reused stale demonstrations after the recall expert changed)."""

    async def rendered() -> list[Any]:
        template = chat_template_for(load_tokenizer(config.tokenizer))
        episodes = record_demonstrations(config, min(DIGEST_TASKS, config.num_tasks))
        return [
            render_transcript(transcript, template)
            async for transcripts, _ in episodes
            for transcript in transcripts
        ]

    text = json.dumps(asyncio.run(rendered()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
