"""Demonstration files: scripted experts' episodes through the real environments, as JSONL.

    python -m libs.experts.demos --env calc --num-tasks 400 --error-rate 0.1 --out calc.jsonl

or from code: `stats = asyncio.run(write_demonstrations(DemoConfig(env="calc", ...), path))`.
Each line is one context segment (libs.sft.transcript), ready for `rlpipe sft`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import random
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.chat.template import ChatTemplate, chat_template_for, render_tool_results
from libs.chat.tool_calls import format_tool_call
from libs.envs import make_env
from libs.envs import recall as recall_env
from libs.experts.calc import CalcExpert
from libs.experts.recall import RecallExpert
from libs.experts.record import Expert, record_episode
from libs.rollout.agent import SUMMARY_RESUME, AgentSettings
from libs.sft.transcript import Transcript, render_transcript, transcript_to_json
from libs.tokenizer import load_tokenizer
from proto.messages import ChatMessage, ToolResult

EXPERTS: dict[str, Callable[[float], Expert]] = {"calc": CalcExpert, "recall": RecallExpert}
# Episodes recorded for `demonstrations_digest` (milliseconds each).
DIGEST_TASKS = 8


def harness_settings(env: str, template: ChatTemplate) -> AgentSettings:
    """The harness limits an environment's demonstrations (and its demo run) use, with token
    counts in `template`'s tokens (the policy's)."""
    if env == recall_env.ENV_NAME:
        return AgentSettings(
            max_turns=24,
            context_budget_tokens=recall_context_budget(template),
            summary_max_tokens=recall_env.SUMMARY_MAX_TOKENS,
            max_summaries=recall_env.MAX_SUMMARIES,
        )
    return AgentSettings()


def recall_context_budget(template: ChatTemplate) -> int:
    """Tokens of a recall context segment: the opening with a summary, REVEALS_PER_SEGMENT
    reveals (a call and its result) and room for one more turn, rendered in `template`: 955
    with the byte tokenizer, 216 with the BPE tokenizer of recall's warm start."""
    task = recall_env.RecallTasks(difficulty=0, group_size=1, seed=0).task(0)
    summary = SUMMARY_RESUME.format(summary="Digits read: 739 (3 of 6).")
    messages = [
        ChatMessage(role="system", content=recall_env.SYSTEM_PROMPT),
        ChatMessage(role="user", content=task.prompt),
        ChatMessage(role="user", content=summary),
    ]
    opening = template.render(messages, tools=recall_env.TOOLS, add_generation_prompt=False)
    call = [
        *template.tokenizer.encode(format_tool_call(recall_env.TOOL_NAME, {})),
        template.stop_token_ids[0],
    ]
    call = [*template.generation_prompt(), *call, *template.end_of_assistant(call)]
    result = ToolResult(call_id="call-3-0", name=recall_env.TOOL_NAME, content="digit 3 of 6: 7")
    reveal = len(call) + len(template.render_message(render_tool_results([result])))
    turn = len(template.generation_prompt()) + recall_env.TURN_MAX_TOKENS
    return len(opening) + recall_env.REVEALS_PER_SEGMENT * reveal + turn


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
    config: DemoConfig, num_tasks: int | None = None
) -> AsyncIterator[tuple[list[Transcript], dict[str, Any]]]:
    """The expert's episodes of `config` (its first `num_tasks`, default all): each one's
    segments as transcripts and the env's final info."""
    if config.env not in EXPERTS:
        raise ValueError(
            f"no scripted expert for env {config.env!r}; experts: {', '.join(EXPERTS)}"
        )
    env = make_env(config.env)
    expert = EXPERTS[config.env](config.error_rate)
    template = chat_template_for(load_tokenizer(config.tokenizer))
    source = env.task_source(difficulty=config.difficulty, group_size=1, seed=config.seed)
    rng = random.Random(config.seed)
    agent = harness_settings(config.env, template)
    for index in range(config.num_tasks if num_tasks is None else num_tasks):
        yield await record_episode(env, source.task(index), expert, agent, template, rng)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="calc", choices=sorted(EXPERTS))
    parser.add_argument("--num-tasks", type=int, default=400)
    parser.add_argument("--error-rate", type=float, default=0.1)
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = DemoConfig(
        args.env, args.num_tasks, args.error_rate, args.difficulty, args.seed, args.tokenizer
    )
    stats = asyncio.run(write_demonstrations(config, args.out))
    print(json.dumps({"out": str(args.out), **stats.as_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
