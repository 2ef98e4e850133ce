"""Serving environments over NATS request/reply: the env-gateway's episode table.

For each environment, `EnvServer` answers `env_op_subject(env, op)` for reset, step and close
in queue group ENV_QUEUE_GROUP, plus this instance's own step and close subjects (named in
every reset reply, so an episode's steps reach the instance that holds it). Every request is
handled in its own task; every failure becomes an error reply with a kind
(proto.messages.ENV_ERROR_*) that ends the episode, never a crashed service. Episodes have a
deadline and are closed when it passes.

`EnvHandler` is the request handling itself (the episode table, encoded request in, reply
out) with no transport; `EnvServer` serves it on the bus, `LocalTransport`
(libs/envs/local_client.py) in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

from libs.bus import wire
from libs.envs.base import Environment, Episode, Opening, StepResult
from proto import messages as m
from proto.subjects import ENV_QUEUE_GROUP, env_op_subject

log = structlog.get_logger(__name__)

REQUESTS = Counter(
    "rlpipe_env_requests_total", "Env requests answered, by outcome", ["env", "op", "outcome"]
)
OPEN_EPISODES = Gauge("rlpipe_env_open_episodes", "Episodes open on this gateway")


class RequestError(Exception):
    """A request that gets an error reply of `kind` (one of proto.messages.ENV_ERROR_*)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class OpenEpisode:
    """An episode this gateway holds."""

    env: str
    episode: Episode
    opening: Opening
    deadline: float  # time.time() after which it is closed
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)


class ServerLimits(BaseModel):
    """How long episodes and steps may run, and how many episodes one gateway holds
    (env-gateway's `limits`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    episode_timeout_s: float = Field(600.0, gt=0, description="Deadline of an episode")
    step_timeout_s: float = Field(30.0, gt=0, description="Longest a reset or step may run")
    max_open_episodes: int = Field(10_000, ge=1, description="Episodes one gateway holds at most")


class EnvHandler:
    """Answers env requests for `envs` (name -> environment): opens, steps and closes their
    episodes, with deadlines and limits; no transport of its own."""

    def __init__(
        self,
        envs: Mapping[str, Environment],
        limits: ServerLimits | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        self._envs = dict(envs)
        self.limits = limits or ServerLimits()
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.episodes: dict[str, OpenEpisode] = {}

    def own_subject(self, env: str, op: str) -> str:
        """This instance's subject for `op` on `env`, e.g. `rl.env.arith.step-1a2b3c`."""
        return env_op_subject(env, f"{op}-{self.instance_id}")

    def routes(self) -> dict[str, tuple[str, str, bool]]:
        """subject -> (env, op, shared): each env's reset, step and close subjects, shared by
        every instance, and this instance's own step and close subjects."""
        routes = {}
        for env in self._envs:
            for op in ("reset", "step", "close"):
                routes[env_op_subject(env, op)] = (env, op, True)
            for op in ("step", "close"):
                routes[self.own_subject(env, op)] = (env, op, False)
        return routes

    async def close_expired(self, now: float | None = None) -> int:
        """Close episodes whose deadline passed; returns how many."""
        now = time.time() if now is None else now
        expired = [eid for eid, ep in self.episodes.items() if ep.deadline < now]
        for episode_id in expired:
            log.info("episode expired", episode_id=episode_id)
            await self._forget(episode_id)
        return len(expired)

    async def answer(
        self, env: str, op: str, data: bytes, headers: Mapping[str, str] | None
    ) -> m.Message:
        """The reply to one encoded request; every failure is an error reply, never a raise."""
        handlers: dict[str, Callable[[str, Any], Awaitable[m.Message]]] = {
            "reset": self.on_reset,
            "step": self.on_step,
            "close": self.on_close,
        }
        request_types: dict[str, type[m.Message]] = {
            "reset": m.EnvResetRequest,
            "step": m.EnvStepRequest,
            "close": m.EnvCloseRequest,
        }
        reply: m.Message
        try:
            request = wire.decode(request_types[op], data, headers)
            reply = await handlers[op](env, request)
            outcome = getattr(reply, "error", "") or "ok"
        except wire.InvalidMessage as exc:
            reply, outcome = _error_reply(op, "", m.ENV_ERROR_BAD_REQUEST, str(exc)), "bad_request"
        except Exception as exc:  # the deliberate catch-all at a handler: answer, keep serving
            log.exception("env request failed", env=env, op=op)
            reply, outcome = _error_reply(op, "", m.ENV_ERROR_ENV_CRASHED, repr(exc)), "crashed"
        REQUESTS.labels(env, op, outcome).inc()
        return reply

    async def on_reset(self, env: str, request: m.EnvResetRequest) -> m.EnvResetReply:
        """Open an episode (or repeat the opening of one already open under that id)."""
        episode_id = request.episode_id
        try:
            opening = await self._open(env, request)
        except RequestError as exc:
            return m.EnvResetReply(episode_id=episode_id, error=exc.kind, error_message=str(exc))
        return m.EnvResetReply(
            episode_id=episode_id,
            observation=opening.observation,
            messages=list(opening.messages),
            tools=list(opening.tools),
            max_turns=opening.max_turns,
            max_tokens=opening.max_tokens,
            stop=list(opening.stop),
            step_subject=self.own_subject(env, "step"),
            close_subject=self.own_subject(env, "close"),
            deadline=self.episodes[episode_id].deadline,
        )

    async def _open(self, env: str, request: m.EnvResetRequest) -> Opening:
        if request.task.env != env:
            raise RequestError(
                m.ENV_ERROR_BAD_REQUEST,
                f"task {request.task.task_id} is for env {request.task.env!r}, sent to {env!r}",
            )
        existing = self.episodes.get(request.episode_id)
        if existing is not None:
            return existing.opening
        if len(self.episodes) >= self.limits.max_open_episodes:
            raise RequestError(
                m.ENV_ERROR_OVERLOADED,
                f"gateway {self.instance_id} holds {len(self.episodes)} episodes "
                "(max_open_episodes); retry later or add a gateway",
            )
        try:
            episode, opening = await asyncio.wait_for(
                self._envs[env].reset(request.task), timeout=self.limits.step_timeout_s
            )
        except TimeoutError:
            limit_s = self.limits.step_timeout_s
            raise RequestError(m.ENV_ERROR_TIMEOUT, f"reset took over {limit_s} s") from None
        except ValueError as exc:
            raise RequestError(m.ENV_ERROR_BAD_REQUEST, str(exc)) from exc
        except Exception as exc:
            raise RequestError(m.ENV_ERROR_ENV_CRASHED, f"reset raised {exc!r}") from exc
        deadline = time.time() + self.limits.episode_timeout_s
        self.episodes[request.episode_id] = OpenEpisode(env, episode, opening, deadline)
        OPEN_EPISODES.set(len(self.episodes))
        return opening

    async def on_step(self, env: str, request: m.EnvStepRequest) -> m.EnvStepReply:
        """Apply an action; an error or `done` ends (forgets) the episode."""
        episode_id = request.episode_id
        try:
            open_episode = self._held(env, episode_id)
            if open_episode.busy.locked():
                # Not forgotten: the running step still owns the episode.
                return m.EnvStepReply(
                    episode_id=episode_id,
                    error=m.ENV_ERROR_BAD_REQUEST,
                    error_message="a step of this episode is still running; send one at a time",
                )
            async with open_episode.busy:
                result = await self._step(open_episode, request)
        except RequestError as exc:
            await self._forget(episode_id)
            return m.EnvStepReply(episode_id=episode_id, error=exc.kind, error_message=str(exc))
        if result.done:
            await self._forget(episode_id)
        return m.EnvStepReply(
            episode_id=episode_id,
            observation=result.observation,
            tool_results=list(result.tool_results),
            done=result.done,
            info=result.info,
        )

    def _held(self, env: str, episode_id: str) -> OpenEpisode:
        open_episode = self.episodes.get(episode_id)
        if open_episode is None or open_episode.env != env:
            raise RequestError(
                m.ENV_ERROR_UNKNOWN_EPISODE,
                f"episode {episode_id!r} of env {env!r} is not open on gateway "
                f"{self.instance_id} (never reset, already done, closed or expired)",
            )
        return open_episode

    async def _step(self, open_episode: OpenEpisode, request: m.EnvStepRequest) -> StepResult:
        timeout_s = min(self.limits.step_timeout_s, max(0.0, open_episode.deadline - time.time()))
        step = open_episode.episode.step(request.action, request.tool_calls)
        try:
            return await asyncio.wait_for(step, timeout=timeout_s)
        except TimeoutError:
            raise RequestError(
                m.ENV_ERROR_TIMEOUT, f"step ran past {timeout_s:.1f} s (step or episode deadline)"
            ) from None
        except Exception as exc:
            raise RequestError(m.ENV_ERROR_ENV_CRASHED, f"step raised {exc!r}") from exc

    async def on_close(self, env: str, request: m.EnvCloseRequest) -> m.EnvCloseReply:
        """Close an episode; closing one that is not open is not an error."""
        held = request.episode_id in self.episodes
        if held:
            await self._forget(request.episode_id)
        return m.EnvCloseReply(episode_id=request.episode_id, closed=held)

    async def _forget(self, episode_id: str) -> None:
        open_episode = self.episodes.pop(episode_id, None)
        OPEN_EPISODES.set(len(self.episodes))
        if open_episode is None:
            return
        try:
            await asyncio.wait_for(open_episode.episode.close(), timeout=self.limits.step_timeout_s)
        except Exception as exc:  # a failing close must not keep the episode or stop the server
            log.warning("episode close failed", episode_id=episode_id, error=repr(exc))


class EnvServer(EnvHandler):
    """Serves `envs` (name -> environment) on connection `nc` until `stop`."""

    def __init__(
        self,
        nc: Client,
        envs: Mapping[str, Environment],
        limits: ServerLimits | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        super().__init__(envs, limits, instance_id=instance_id)
        self._nc = nc
        self._subs: list[Subscription] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Subscribe to every env's reset, step and close subjects (the shared ones in the
        queue group, so one instance answers each request)."""
        for subject, (env, op, shared) in self.routes().items():
            group = ENV_QUEUE_GROUP if shared else ""
            self._subs.append(await self._nc.subscribe(subject, group, cb=self._callback(env, op)))
        log.info("serving environments", envs=sorted(self._envs), instance=self.instance_id)

    def _callback(self, env: str, op: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_request(msg: Msg) -> None:
            # One task per request: a slow step must not hold up other episodes.
            task = asyncio.create_task(self._answer(env, op, msg))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

        return on_request

    async def run(self) -> None:
        """Close expired episodes until `stop`."""
        interval_s = min(1.0, self.limits.episode_timeout_s / 4)
        while not self._stopping.is_set():
            await self.close_expired()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=interval_s)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop answering, let running requests finish for `grace_s`, close every episode."""
        self._stopping.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=grace_s)
        for episode_id in list(self.episodes):
            await self._forget(episode_id)

    async def _answer(self, env: str, op: str, msg: Msg) -> None:
        reply = await self.answer(env, op, msg.data, dict(msg.headers or {}))
        if msg.reply:
            with contextlib.suppress(Exception):  # the caller may be gone; nothing to do then
                await self._nc.publish(
                    msg.reply, wire.encode(reply), headers={wire.SCHEMA_HEADER: reply.schema_id()}
                )


def _error_reply(op: str, episode_id: str, kind: str, message: str) -> m.Message:
    reply_types: dict[str, type[m.EnvResetReply | m.EnvStepReply | m.EnvCloseReply]] = {
        "reset": m.EnvResetReply,
        "step": m.EnvStepReply,
        "close": m.EnvCloseReply,
    }
    return reply_types[op](episode_id=episode_id, error=kind, error_message=message[:2000])
