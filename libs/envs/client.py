"""The caller's side of the env protocol: reset, step and close episodes over the bus.

    client = EnvClient(bus.nc)
    opening = await client.reset(task)                    # opening.episode_id, .observation
    reply = await client.step(opening.episode_id, task.env, action)
    if not reply.done: ...                                # multi-turn: step again
    await client.close(opening.episode_id, task.env)      # harmless after done

Every failure raises `EnvError` with a `kind` (proto.messages.ENV_ERROR_*): an error reply
from the gateway, no reply in time (`timeout`), or nobody serving the env (`unknown_env`).
After an EnvError the episode is over: the gateway has forgotten it.
"""

from __future__ import annotations

import uuid
from typing import TypeVar

import nats.errors
from nats.aio.client import Client

from libs.bus import wire
from proto import messages as m
from proto.subjects import env_op_subject

R = TypeVar("R", m.EnvResetReply, m.EnvStepReply, m.EnvCloseReply)


class EnvError(Exception):
    """An episode ended by an error of `kind` (one of proto.messages.ENV_ERROR_*)."""

    def __init__(self, kind: str, message: str, episode_id: str = "") -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.episode_id = episode_id


class EnvClient:
    """Talks to env-gateway on connection `nc`; remembers which gateway holds each episode."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        # episode id -> (step subject, close subject) of the gateway instance holding it.
        self._routes: dict[str, tuple[str, str]] = {}

    @property
    def num_open(self) -> int:
        """Episodes this client opened and has not seen end."""
        return len(self._routes)

    async def reset(
        self, task: m.Task, timeout_s: float = 10.0, episode_id: str | None = None
    ) -> m.EnvResetReply:
        """Open an episode on `task`; `episode_id` defaults to a fresh uuid."""
        episode_id = episode_id or uuid.uuid4().hex
        request = m.EnvResetRequest(episode_id=episode_id, task=task)
        reply = await self._request(
            env_op_subject(task.env, "reset"), request, m.EnvResetReply, timeout_s, episode_id
        )
        self._routes[episode_id] = (
            reply.step_subject or env_op_subject(task.env, "step"),
            reply.close_subject or env_op_subject(task.env, "close"),
        )
        return reply

    async def step(
        self,
        episode_id: str,
        env: str,
        action: str,
        timeout_s: float = 30.0,
        tool_calls: list[m.ToolCall] | None = None,
    ) -> m.EnvStepReply:
        """Send the policy's `action` (and the tool calls parsed from it); a reply with
        `done` ends the episode."""
        subject = self._routes.get(episode_id, (env_op_subject(env, "step"), ""))[0]
        request = m.EnvStepRequest(
            episode_id=episode_id, action=action, tool_calls=tool_calls or []
        )
        try:
            reply = await self._request(subject, request, m.EnvStepReply, timeout_s, episode_id)
        except EnvError:
            self._routes.pop(episode_id, None)
            raise
        if reply.done:
            self._routes.pop(episode_id, None)
        return reply

    async def close(self, episode_id: str, env: str, timeout_s: float = 5.0) -> bool:
        """End the episode; returns False when the gateway no longer held it (done, expired)."""
        route = self._routes.pop(episode_id, None)
        subject = route[1] if route else env_op_subject(env, "close")
        request = m.EnvCloseRequest(episode_id=episode_id)
        reply = await self._request(subject, request, m.EnvCloseReply, timeout_s, episode_id)
        return reply.closed

    async def _request(
        self,
        subject: str,
        request: m.Message,
        reply_type: type[R],
        timeout_s: float,
        episode_id: str,
    ) -> R:
        headers = {wire.SCHEMA_HEADER: request.schema_id()}
        try:
            msg = await self._nc.request(
                subject, wire.encode(request), timeout=timeout_s, headers=headers
            )
        except nats.errors.NoRespondersError:
            raise EnvError(
                m.ENV_ERROR_UNKNOWN_ENV,
                f"nobody answers {subject}: is env-gateway running and serving this env "
                "(or did the gateway holding this episode stop)?",
                episode_id,
            ) from None
        except nats.errors.TimeoutError:
            raise EnvError(
                m.ENV_ERROR_TIMEOUT, f"no reply on {subject} within {timeout_s} s", episode_id
            ) from None
        try:
            reply = wire.decode(reply_type, msg.data, dict(msg.headers or {}))
        except wire.InvalidMessage as exc:
            raise EnvError(m.ENV_ERROR_BAD_REQUEST, f"unreadable reply: {exc}", episode_id) from exc
        if reply.error:
            raise EnvError(reply.error, reply.error_message, episode_id)
        return reply
