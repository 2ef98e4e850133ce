"""Roll out one task as a GRPO group of single-turn episodes: reset, sample, step, record.

    runner = SingleTurnRunner(EnvClient(bus.nc), tokenizer, batcher.generate, worker_id="w1")
    rollouts = await runner.run(task)       # task.group_size Rollouts, ready to publish

Each of the group's samples is its own episode on env-gateway (reset per sample, so an
environment may open each differently). The opening observation is the prompt; the samples
are generated together (one request per distinct max_tokens/stop, usually one per task) and
each completion's text is the action of one step. Rollout ids are `<task_id>.<i>`, so a
redelivered task rolls out under the same ids and the stream's dedup drops the repeats.

Errors: a failed reset (no rollout could start) raises the EnvError after closing the
episodes that did open: the caller retries the task or, for `bad_request`, rejects it. A
failed step happens after the policy acted: that rollout is still returned, with finish
reason `env_error`, and reward decides what it is worth. An episode the environment does
not end after one action is closed and finishes as `max_turns`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import structlog

from libs.engine.base import Completion, SamplingParams
from libs.envs.client import EnvClient, EnvError
from libs.tokenizer import Tokenizer
from proto.messages import EnvResetReply, Rollout, Task, Turn

log = structlog.get_logger(__name__)

RolloutFinish = Literal["stop", "length", "max_turns", "env_error", "timeout"]
GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]


@dataclass(frozen=True)
class RunnerSettings:
    """How a runner samples and how long it waits for the environment."""

    worker_id: str
    temperature: float = 1.0
    top_p: float = 1.0
    reset_timeout_s: float = 10.0
    step_timeout_s: float = 30.0


def rollout_id(task_id: str, sample_index: int) -> str:
    """Id of sample `sample_index` of task `task_id`: the same on every delivery."""
    return f"{task_id}.{sample_index}"


class SingleTurnRunner:
    """Rolls out tasks whose episodes take one action (the built-in tasks)."""

    def __init__(
        self,
        env: EnvClient,
        tokenizer: Tokenizer,
        generate: GenerateFn,
        settings: RunnerSettings,
    ) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.generate = generate
        self.settings = settings

    async def run(self, task: Task) -> list[Rollout]:
        """`task.group_size` finished rollouts of `task`, in sample order."""
        return await self.run_opened(task, await self.reset_all(task))

    async def run_opened(self, task: Task, openings: list[EnvResetReply]) -> list[Rollout]:
        """Roll out episodes already opened by `reset_all`, one per sample."""
        try:
            completions = await self._sample(openings)
        except BaseException:
            await self.close_all(task, openings)
            raise
        pairs = enumerate(zip(openings, completions, strict=True))
        return list(await asyncio.gather(*(self._finish(task, i, o, c) for i, (o, c) in pairs)))

    async def reset_all(self, task: Task) -> list[EnvResetReply]:
        """One open episode per sample; on any failure, close the rest and raise."""
        if task.group_size < 1:
            raise ValueError(f"task {task.task_id}: group_size must be >= 1, got {task.group_size}")
        # Fresh episode ids: a redelivered task must not resume a half-done earlier episode.
        nonce = uuid.uuid4().hex[:8]
        ids = [f"{rollout_id(task.task_id, i)}-{nonce}" for i in range(task.group_size)]
        timeout_s = self.settings.reset_timeout_s
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

    async def _sample(self, openings: list[EnvResetReply]) -> list[Completion]:
        """One completion per opening; openings that agree on limits share a request."""
        groups: dict[tuple[int, tuple[str, ...]], list[int]] = {}
        for index, opening in enumerate(openings):
            groups.setdefault((opening.max_tokens, tuple(opening.stop)), []).append(index)
        prompts = [self.tokenizer.encode(opening.observation) for opening in openings]
        requests = [
            self.generate([prompts[i] for i in indices], self._params(max_tokens, stop))
            for (max_tokens, stop), indices in groups.items()
        ]
        out: list[Completion | None] = [None] * len(openings)
        results = await asyncio.gather(*requests)
        for indices, completions in zip(groups.values(), results, strict=True):
            for index, completion in zip(indices, completions, strict=True):
                out[index] = completion
        assert all(c is not None for c in out), "every opening got a completion"
        return [c for c in out if c is not None]

    def _params(self, max_tokens: int, stop: tuple[str, ...]) -> SamplingParams:
        if max_tokens < 1:
            raise ValueError(f"the environment allows {max_tokens} tokens; it must allow >= 1")
        return SamplingParams(
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            max_tokens=max_tokens,
            stop_token_ids=(self.tokenizer.eos_id,),
            stop_strings=stop,
        )

    async def _finish(
        self, task: Task, index: int, opening: EnvResetReply, completion: Completion
    ) -> Rollout:
        """Step the episode with the completion's text and record the rollout."""
        text = self.tokenizer.decode(completion.token_ids)
        finish_reason: RolloutFinish = completion.finish_reason
        try:
            reply = await self.env.step(
                opening.episode_id, task.env, text, self.settings.step_timeout_s
            )
            if not reply.done:
                finish_reason = "max_turns"
                with contextlib.suppress(EnvError):
                    await self.env.close(opening.episode_id, task.env)
        except EnvError as exc:
            log.warning("env step failed", task_id=task.task_id, sample=index, error=str(exc))
            finish_reason = "env_error"
        prompt = self.tokenizer.encode(opening.observation)
        return Rollout(
            rollout_id=rollout_id(task.task_id, index),
            task_id=task.task_id,
            group_id=task.task_id,
            sample_index=index,
            env=task.env,
            turns=[
                Turn(role="user", token_ids=prompt, text=opening.observation),
                Turn(
                    role="assistant",
                    token_ids=completion.token_ids,
                    text=text,
                    logprobs=completion.logprobs,
                    policy_version=completion.policy_version,
                ),
            ],
            finish_reason=finish_reason,
            worker_id=self.settings.worker_id,
            task=task,
            created_at=time.time(),
        )

    async def close_all(self, task: Task, openings: list[EnvResetReply]) -> None:
        """Close episodes best-effort (the gateway expires what this misses)."""
        for opening in openings:
            with contextlib.suppress(EnvError):
                await self.env.close(opening.episode_id, task.env)
