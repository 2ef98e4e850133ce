"""Recording a scripted expert's episodes through the real environment, as SFT transcripts.

The recorder is the harness's turn loop (libs.rollout.agent) with an expert in place of the
engine: the environment's own `reset` and `Episode.step` answer, the expert's text is parsed
by the harness's parser with the harness's call ids, tool results are ordered and rendered as
the harness renders them, and self-summarization triggers at the same token count (measured
with the same chat template). So a demonstration is exactly what the policy sees in an episode.

    transcripts, info = await record_episode(env, task, expert, agent, template, rng)

Each returned transcript is one context segment; a summarizing episode gives several.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from libs.chat.template import ChatTemplate
from libs.chat.tool_calls import parse_tool_calls
from libs.envs.base import Environment, Opening
from libs.rollout.agent import SUMMARY_REQUEST, SUMMARY_RESUME, AgentSettings, ordered_results
from libs.sft.transcript import SftCall, SftMessage, Transcript, assistant_text, render_transcript
from proto.messages import Task, ToolResult


@dataclass(frozen=True)
class ExpertTurn:
    """What the expert writes in one turn: text, then its calls (none: the final answer)."""

    content: str = ""
    calls: tuple[SftCall, ...] = ()


class EpisodeExpert(abc.ABC):
    """A scripted policy for one episode; it sees what the policy would see, turn by turn."""

    def observe(self, results: Sequence[ToolResult], observation: str) -> None:  # noqa: B027
        """Take in what the last turn led to: its tool results and the env's observation."""

    @abc.abstractmethod
    def turn(self) -> ExpertTurn:
        """The next turn."""

    def summary(self) -> str:
        """The summary the expert writes when the context is full."""
        raise NotImplementedError(f"{type(self).__name__} does not summarize")


class Expert(abc.ABC):
    """Scripted demonstrations for one environment; `error_rate` is the chance of a mistake
    at each decision the expert makes (an operand, a digit), so demonstrations are imperfect."""

    env: str

    def __init__(self, error_rate: float = 0.0) -> None:
        if not 0 <= error_rate <= 1:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate = error_rate

    @abc.abstractmethod
    def begin(self, task: Task, opening: Opening, rng: random.Random) -> EpisodeExpert:
        """An expert for one episode of `task`."""


@dataclass
class _Recording:
    """The segments written so far and the messages of the current one."""

    opening: Opening
    segments: list[Transcript] = field(default_factory=list)
    messages: list[SftMessage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [_sft(message.role, message.content) for message in self.opening.messages]

    def close_segment(self) -> None:
        self.segments.append(Transcript(tuple(self.messages), self.opening.tools))

    def length(self, template: ChatTemplate) -> int:
        return len(
            render_transcript(Transcript(tuple(self.messages), self.opening.tools), template)[0]
        )


async def record_episode(
    env: Environment,
    task: Task,
    expert: Expert,
    agent: AgentSettings,
    template: ChatTemplate,
    rng: random.Random,
) -> tuple[list[Transcript], dict[str, Any]]:
    """One expert episode of `task` on `env`: its segments as transcripts, and the env's final
    info (empty when the episode did not end with an answer)."""
    episode, opening = await env.reset(task)
    try:
        recording = _Recording(opening)
        player = expert.begin(task, opening, rng)
        info = await _turn_loop(episode, opening, player, agent, template, recording)
    finally:
        await episode.close()
    recording.close_segment()
    meta = {"env": task.env, "task_id": task.task_id, **info}
    segments = [
        Transcript(s.messages, s.tools, meta | {"segment": i})
        for i, s in enumerate(recording.segments)
    ]
    return segments, info


async def _turn_loop(
    episode: Any,
    opening: Opening,
    player: EpisodeExpert,
    agent: AgentSettings,
    template: ChatTemplate,
    recording: _Recording,
) -> dict[str, Any]:
    tool_names = {tool.name for tool in opening.tools}
    max_turns = min(opening.max_turns or agent.max_turns, agent.max_turns)
    for turn_index in range(max_turns):
        if not _make_room(opening, player, agent, template, recording):
            return {}
        move = player.turn()
        text = assistant_text(move.content, move.calls)
        parsed = parse_tool_calls(text, tool_names, f"call-{turn_index}")
        calls = tuple(SftCall(c.name, c.arguments, c.call_id) for c in parsed.calls)
        recording.messages.append(SftMessage("assistant", move.content, tool_calls=calls))
        reply = (
            await episode.step(text, parsed.calls) if parsed.calls or not parsed.invalid else None
        )
        if reply is not None and reply.done:
            return dict(reply.info)
        results = ordered_results(parsed, reply.tool_results if reply else ())
        observation = reply.observation if reply else ""
        player.observe(results, observation)
        recording.messages += [
            SftMessage("tool", r.content, call_id=r.call_id, name=r.name, error=r.error)
            for r in results
        ]
        if observation:
            recording.messages.append(_sft("user", observation))
    return {}


def _make_room(
    opening: Opening,
    player: EpisodeExpert,
    agent: AgentSettings,
    template: ChatTemplate,
    recording: _Recording,
) -> bool:
    """The harness's rule: summarize when the next turn could pass the budget."""
    needed = len(template.generation_prompt()) + opening.max_tokens
    if recording.length(template) + needed <= agent.context_budget_tokens:
        return True
    summaries = len(recording.segments)
    if not agent.summarize or summaries + 1 > agent.max_summaries:
        return False
    summary = player.summary()
    recording.messages += [_sft("user", SUMMARY_REQUEST), _sft("assistant", summary)]
    recording.close_segment()
    recording.messages = [_sft(m.role, m.content) for m in opening.messages]
    recording.messages.append(_sft("user", SUMMARY_RESUME.format(summary=summary)))
    return recording.length(template) + needed <= agent.context_budget_tokens


def _sft(role: str, content: str) -> SftMessage:
    return SftMessage(role=role, content=content)
