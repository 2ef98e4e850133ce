"""The multi-turn harness: tool-calling episodes between the engine and env-gateway.

    runner = AgentRunner(EnvClient(bus.nc), tokenizer, batcher.generate, runner_settings)
    rollouts = await runner.run(task)       # task.group_size Rollouts, ready to publish

This is the one rollout path: every rollout, evaluation included, runs here. Per sample, one
episode on env-gateway (a reset per sample, so an environment may open each differently).
A reset that answers with `messages` and `tools` is a chat; one that answers with a bare
`observation` (a single-turn text environment such as `arith`) is plain text: the same loop
with `PlainTextTemplate` (no role markers, the tokenizer's eos ends the turn), usually ended
by the environment after one action. The environment's verdict (the final step's `info`)
is kept on the rollout, so reward uses it where the environment already decided.

    context  <- template of the opening messages, tools listed in the system message
    repeat up to max_turns:
        assistant turn <- engine(context + generation prompt)     ids and logprobs kept as is
        calls <- parse the turn's text (libs.chat.tool_calls); none: the final answer
        reply <- env step(text, well-formed calls); invalid calls are answered here with an
                 error result and counted, never sent
        done: stop; else context += tool results (and the env's observation, if any)

Tokens are never re-tokenized: the rollout's turns are exactly the ids the engine consumed and
produced, so the trainer's importance weights stay valid across turns. Assistant turns carry
their logprobs and policy version; everything else (opening, tool results, template markers)
is a non-assistant turn, masked out of the loss.

Self-summarization: before a turn, when the segment's context plus the turn's token limit
passes `context_budget_tokens`, the policy is asked to summarize its progress; the context
restarts from the opening messages and that summary (a new `Turn.segment`). Each segment is
one training row sharing the episode's reward. The budget is a worker setting, so the trigger
is the same for every sample of a group.

Finish reasons: an episode the environment ends finishes as `stop`; turns that max_tokens
cut are counted (`Rollout.stats`, EPISODE_STAT_TRUNCATED_TURNS), so a reward can tell a
clean answer from a truncated one. An env error ends the episode with finish reason
`env_error` and the kind recorded (`Rollout.env_error`); an episode past
`episode_timeout_s` ends as `timeout`; both are still published, and reward decides what
they are worth. A failed reset (no episode of the group could start) raises the EnvError
after closing the episodes that did open: the caller retries the task or, for
`bad_request`, rejects it. Engine failures propagate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from libs.chat.template import (
    ChatTemplate,
    PlainTextTemplate,
    chat_template_for,
    render_tool_results,
)
from libs.chat.tool_calls import ParsedTurn, parse_tool_calls
from libs.engine.base import Completion, SamplingParams
from libs.envs.client import EnvClient, EnvError
from libs.rollout.episode import GenerateFn, RolloutFinish, RunnerSettings
from libs.rollout.episode import rollout_id as make_rollout_id
from libs.rollout.turn_routing import EpisodeRouting
from libs.tokenizer import Tokenizer
from proto import messages as m
from proto.messages import ChatMessage, EnvResetReply, Rollout, Task, ToolResult, Turn

log = structlog.get_logger(__name__)

SUMMARY_REQUEST = (
    "Your context is almost full. Summarize your progress for yourself: the task, what you "
    "did, what you found, and what is left to do. Write only the summary."
)
EPISODE_STATS = (
    m.EPISODE_STAT_TURNS,
    m.EPISODE_STAT_TOOL_CALLS,
    m.EPISODE_STAT_INVALID_TOOL_CALLS,
    m.EPISODE_STAT_TOOL_ERRORS,
    m.EPISODE_STAT_SEGMENTS,
    m.EPISODE_STAT_GENERATED_TOKENS,
    m.EPISODE_STAT_TRUNCATED_TURNS,
)
SUMMARY_RESUME = "Summary of your progress so far:\n{summary}\n\nContinue the task from there."


class AgentSettings(BaseModel):
    """Limits of the turn loop and the self-summarization trigger (the rollout-worker's
    settings carry these fields as they are)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(
        16, ge=1, description="Most assistant turns per episode (an env's smaller limit wins)"
    )
    # Keep it below the model's context length by at least summary_max_tokens plus the
    # summary request; the rollout-worker caps it at the engine's positions.
    context_budget_tokens: int = Field(
        4096, ge=2, description="Tokens of one context segment before the policy summarizes"
    )
    summarize: bool = Field(True, description="Self-summarize past the budget (else end)")
    summary_max_tokens: int = Field(256, ge=1, description="Longest summary")
    max_summaries: int = Field(4, ge=0, description="Most summaries per episode")
    episode_timeout_s: float = Field(600.0, gt=0, description="Wall clock of one episode")


@dataclass
class Transcript:
    """An episode's turns so far and the token context of its current segment."""

    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # ids of the current segment
    pending: list[int] = field(default_factory=list)  # non-assistant ids not yet in a turn
    pending_role: Literal["user", "tool"] = "user"
    segment: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    routing: EpisodeRouting = field(default_factory=EpisodeRouting)  # MoE policies only

    def count(self, key: str, amount: float = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + amount

    def queue(self, ids: Sequence[int], role: Literal["user", "tool"]) -> None:
        """Add ids the policy did not generate; they become one masked turn at the next flush."""
        self.pending.extend(ids)
        if role == "tool":
            self.pending_role = "tool"

    def flush(self, tokenizer: Tokenizer) -> None:
        if not self.pending:
            return
        text = tokenizer.decode(self.pending, skip_special=False)
        self.turns.append(
            Turn(
                role=self.pending_role,
                token_ids=list(self.pending),
                text=text,
                segment=self.segment,
            )
        )
        self.context.extend(self.pending)
        self.pending, self.pending_role = [], "user"

    def add_assistant(self, completion: Completion, text: str) -> None:
        self.turns.append(
            Turn(
                role="assistant",
                token_ids=list(completion.token_ids),
                text=text,
                logprobs=list(completion.logprobs),
                policy_version=completion.policy_version,
                policy_version_end=completion.policy_version_end,
                version_switches=completion.version_switches,
                policy_version_hash=completion.policy_version_hash,
                policy_version_end_hash=completion.policy_version_end_hash,
                segment=self.segment,
            )
        )
        self.routing.add(self.segment, completion.routed_experts)
        self.context.extend(completion.token_ids)
        self.count(m.EPISODE_STAT_GENERATED_TOKENS, len(completion.token_ids))
        if completion.finish_reason == "length":
            self.count(m.EPISODE_STAT_TRUNCATED_TURNS)

    def new_segment(self) -> None:
        self.segment += 1
        self.context = []
        self.count(m.EPISODE_STAT_SEGMENTS)


@dataclass
class EpisodeEnd:
    """How an episode ended."""

    finish_reason: RolloutFinish
    env_done: bool = False
    """The environment ended the episode (nothing left to close)."""
    env_info: dict[str, Any] = field(default_factory=dict)
    env_error: str = ""
    env_error_message: str = ""


class AgentRunner:
    """Rolls out tasks as groups of episodes: chats with tools, or plain-text turns."""

    def __init__(
        self,
        env: EnvClient,
        tokenizer: Tokenizer,
        generate: GenerateFn,
        settings: RunnerSettings,
        agent: AgentSettings | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.generate = generate
        self.settings = settings
        self.agent = agent or AgentSettings()
        self.template = template or chat_template_for(tokenizer)
        self.plain = PlainTextTemplate(tokenizer)

    async def run(self, task: Task) -> list[Rollout]:
        """`task.group_size` finished rollouts of `task`, in sample order."""
        openings = await self.reset_all(task)
        try:
            episodes = (self.run_episode(task, i, o) for i, o in enumerate(openings))
            return list(await asyncio.gather(*episodes))
        except BaseException:
            await self.close_all(task, openings)
            raise

    async def reset_all(self, task: Task) -> list[EnvResetReply]:
        """One open episode per sample; on any failure, close the rest and raise."""
        if task.group_size < 1:
            raise ValueError(f"task {task.task_id}: group_size must be >= 1, got {task.group_size}")
        # Fresh episode ids: a redelivered task must not resume a half-done earlier episode.
        nonce = uuid.uuid4().hex[:8]
        ids = [f"{make_rollout_id(task.task_id, i)}-{nonce}" for i in range(task.group_size)]
        timeout_s = self.settings.env_reset_timeout_s
        replies = await asyncio.gather(
            *(self.env.reset(task, timeout_s, episode_id) for episode_id in ids),
            return_exceptions=True,
        )
        opened = [r for r in replies if isinstance(r, EnvResetReply)]
        failed = [r for r in replies if not isinstance(r, EnvResetReply)]
        if failed:
            await self.close_all(task, opened)
            raise failed[0]
        return opened

    async def close_all(self, task: Task, openings: list[EnvResetReply]) -> None:
        """Close episodes best-effort (the gateway expires what this misses)."""
        for opening in openings:
            with contextlib.suppress(EnvError):
                await self.env.close(opening.episode_id, task.env)

    def template_for(self, opening: EnvResetReply) -> ChatTemplate:
        """The chat template for a chat opening, plain text for a bare observation."""
        return self.template if opening.messages or opening.tools else self.plain

    async def run_episode(self, task: Task, index: int, opening: EnvResetReply) -> Rollout:
        """Run one opened episode to its end and record it."""
        transcript = Transcript(stats=dict.fromkeys(EPISODE_STATS, 0.0))
        transcript.stats[m.EPISODE_STAT_SEGMENTS] = 1
        try:
            async with asyncio.timeout(self.agent.episode_timeout_s):
                end = await self._turn_loop(task, opening, transcript)
        except TimeoutError:
            log.warning("episode timed out", task_id=task.task_id, sample=index)
            end = EpisodeEnd("timeout")
        except EnvError as exc:
            log.warning("env error ended episode", task_id=task.task_id, error=str(exc))
            end = EpisodeEnd("env_error", env_error=exc.kind, env_error_message=str(exc)[:2000])
        if not end.env_done and not end.env_error:
            with contextlib.suppress(EnvError):
                await self.env.close(opening.episode_id, task.env)
        transcript.flush(self.tokenizer)
        transcript.routing.attach(transcript.turns)
        return Rollout(
            rollout_id=make_rollout_id(task.task_id, index),
            task_id=task.task_id,
            group_id=task.task_id,
            sample_index=index,
            env=task.env,
            turns=transcript.turns,
            finish_reason=end.finish_reason,
            worker_id=self.settings.worker_id,
            task=task,
            created_at=time.time(),
            env_info=end.env_info,
            env_error=end.env_error,
            env_error_message=end.env_error_message,
            stats=transcript.stats,
        )

    async def _turn_loop(
        self, task: Task, opening: EnvResetReply, transcript: Transcript
    ) -> EpisodeEnd:
        tools = opening.tools
        tool_names = {tool.name for tool in tools}
        template = self.template_for(opening)
        params = self._params(opening)
        max_turns = min(opening.max_turns or self.agent.max_turns, self.agent.max_turns)
        transcript.queue(self._opening_ids(opening), "user")
        for turn_index in range(max_turns):
            if not await self._make_room(opening, transcript, params.max_tokens):
                return EpisodeEnd("length")
            completion, text = await self._assistant_turn(transcript, params, template)
            transcript.count(m.EPISODE_STAT_TURNS)
            parsed = parse_tool_calls(text, tool_names, f"call-{turn_index}")
            reply = await self._step(task, opening, text, parsed, transcript)
            if reply.done:
                return EpisodeEnd("stop", env_done=True, env_info=dict(reply.info))
            follow = self._follow_up(parsed, reply)
            transcript.queue(
                template.render_continuation_body(completion.token_ids, follow),
                "tool" if parsed.calls or parsed.invalid else "user",
            )
        return EpisodeEnd("max_turns")

    def _opening_ids(self, opening: EnvResetReply) -> list[int]:
        messages = opening.messages or [ChatMessage(role="user", content=opening.observation)]
        return self.template_for(opening).render(
            messages, tools=opening.tools, add_generation_prompt=False
        )

    async def _assistant_turn(
        self, transcript: Transcript, params: SamplingParams, template: ChatTemplate
    ) -> tuple[Completion, str]:
        """Generate one assistant turn on the segment's context (generation prompt added)."""
        transcript.queue(template.generation_prompt(), "user")
        transcript.flush(self.tokenizer)
        completion = (await self.generate([list(transcript.context)], params))[0]
        text = self.tokenizer.decode(completion.token_ids)
        transcript.add_assistant(completion, text)
        return completion, text

    async def _step(
        self,
        task: Task,
        opening: EnvResetReply,
        text: str,
        parsed: ParsedTurn,
        transcript: Transcript,
    ) -> m.EnvStepReply:
        """Send the turn to the environment, unless it holds only invalid calls."""
        transcript.count(m.EPISODE_STAT_TOOL_CALLS, len(parsed.calls))
        transcript.count(m.EPISODE_STAT_INVALID_TOOL_CALLS, len(parsed.invalid))
        if parsed.invalid and not parsed.calls:
            return m.EnvStepReply(episode_id=opening.episode_id)
        reply = await self.env.step(
            opening.episode_id,
            task.env,
            text,
            self.settings.env_step_timeout_s,
            tool_calls=parsed.calls,
        )
        transcript.count(m.EPISODE_STAT_TOOL_ERRORS, sum(bool(r.error) for r in reply.tool_results))
        return reply

    def _follow_up(self, parsed: ParsedTurn, reply: m.EnvStepReply) -> list[ChatMessage]:
        """Messages after the assistant turn: tool results in call order, then any observation."""
        messages: list[ChatMessage] = []
        results = ordered_results(parsed, reply.tool_results)
        if results:
            messages.append(render_tool_results(results))
        if reply.observation:
            messages.append(ChatMessage(role="user", content=reply.observation))
        return messages

    async def _make_room(
        self, opening: EnvResetReply, transcript: Transcript, turn_max_tokens: int
    ) -> bool:
        """Summarize when the next turn could pass the budget; False when it cannot fit."""
        template = self.template_for(opening)
        needed = len(template.generation_prompt()) + turn_max_tokens
        budget = self.agent.context_budget_tokens
        if self._context_length(transcript) + needed <= budget:
            return True
        if not self.agent.summarize or not template.supports_summaries:
            return False
        if transcript.stats.get(m.EPISODE_STAT_SEGMENTS, 1) > self.agent.max_summaries:
            return False
        if len(self._resume_ids(opening, summary="")) + needed > budget:
            return False  # even an empty summary leaves no room: summarizing cannot help
        await self._summarize(opening, transcript)
        return self._context_length(transcript) + needed <= budget

    async def _summarize(self, opening: EnvResetReply, transcript: Transcript) -> None:
        """The policy writes a summary (trained, in this segment); the next segment starts
        from the opening and the summary."""
        request = ChatMessage(role="user", content=SUMMARY_REQUEST)
        transcript.queue(self.template.render_message(request), "user")
        params = self._params(opening, max_tokens=self.agent.summary_max_tokens)
        completion, summary = await self._assistant_turn(transcript, params, self.template)
        log.debug(
            "episode summarized", segment=transcript.segment, tokens=len(completion.token_ids)
        )
        transcript.queue(self.template.end_of_assistant(completion.token_ids), "user")
        transcript.flush(self.tokenizer)
        transcript.new_segment()
        transcript.queue(self._resume_ids(opening, summary), "user")

    def _resume_ids(self, opening: EnvResetReply, summary: str) -> list[int]:
        """The context a new segment starts from: the opening, then the summary."""
        messages = opening.messages or [ChatMessage(role="user", content=opening.observation)]
        resume = ChatMessage(role="user", content=SUMMARY_RESUME.format(summary=summary))
        return self.template.render(
            [*messages, resume], tools=opening.tools, add_generation_prompt=False
        )

    @staticmethod
    def _context_length(transcript: Transcript) -> int:
        return len(transcript.context) + len(transcript.pending)

    def _params(self, opening: EnvResetReply, max_tokens: int | None = None) -> SamplingParams:
        limit = max_tokens or opening.max_tokens
        if limit < 1:
            raise ValueError(f"the environment allows {limit} tokens; it must allow >= 1")
        template = self.template_for(opening)
        stop_ids = tuple(dict.fromkeys((*template.stop_token_ids, self.tokenizer.eos_id)))
        return SamplingParams(
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            max_tokens=limit,
            stop_token_ids=stop_ids,
            stop_strings=tuple(opening.stop),
        )


def ordered_results(parsed: ParsedTurn, env_results: Sequence[ToolResult]) -> list[ToolResult]:
    """One result per attempted call, in the order the policy wrote them: the environment's
    for well-formed calls, an error for invalid ones (and for a call the env did not answer)."""
    by_id = {result.call_id: result for result in env_results}
    results = [
        by_id.get(call.call_id)
        or ToolResult(
            call_id=call.call_id,
            name=call.name,
            content="the environment returned no result for this call",
            error=m.TOOL_ERROR_FAILED,
        )
        for call in parsed.calls
    ]
    results += [
        ToolResult(
            call_id=bad.call_id, name="", content=f"invalid tool call: {bad.reason}", error=bad.kind
        )
        for bad in parsed.invalid
    ]
    return sorted(results, key=lambda result: _call_number(result.call_id))


def _call_number(call_id: str) -> int:
    _, _, number = call_id.rpartition("-")
    return int(number) if number.isdigit() else 0
