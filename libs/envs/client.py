"""The caller's side of the env protocol: reset, step and close episodes over the bus.

    client = EnvClient(bus.nc)
    opening = await client.reset(task)                    # opening.episode_id, .observation
    reply = await client.step(opening.episode_id, task.env, action)
    if not reply.done: ...                                # multi-turn: step again
    await client.close(opening.episode_id, task.env)      # harmless after done

Every failure raises `EnvError` with a `kind` (proto.messages.ENV_ERROR_*): an error reply
from the gateway, no reply in time (`timeout`), or nobody serving the env (`unknown_env`).
After an EnvError the episode is over: the gateway has forgotten it.

Requests travel through an `EnvTransport` (one method: encoded request in, encoded reply
out): `NatsTransport` over the bus, which `EnvClient(nc)` uses, or `LocalTransport`
(libs/envs/local_client.py) to the gateway's own handler in this process.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Protocol, TypeVar

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


class NobodyServes(Exception):
    """No server answers the subject a request was sent to."""


class EnvTransport(Protocol):
    """Carries one encoded env request to whoever serves `subject` and returns the reply's
    bytes and headers; NobodyServes when nobody serves it, TimeoutError after `timeout_s`."""

    async def request(
        self, subject: str, payload: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[bytes, Mapping[str, str]]: ...


class NatsTransport:
    """Env requests over the bus: NATS request/reply on connection `nc`."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def request(
        self, subject: str, payload: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[bytes, Mapping[str, str]]:
        try:
            msg = await self._nc.request(subject, payload, timeout=timeout_s, headers=dict(headers))
        except nats.errors.NoRespondersError:
            raise NobodyServes(subject) from None
        except nats.errors.TimeoutError:
            raise TimeoutError(subject) from None
        return msg.data, msg.headers or {}


class EnvClient:
    """Talks to env-gateway through `transport` (a NATS connection: over the bus);
    remembers which gateway holds each episode."""

    def __init__(self, transport: Client | EnvTransport) -> None:
        self._transport = NatsTransport(transport) if isinstance(transport, Client) else transport
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
            data, reply_headers = await self._transport.request(
                subject, wire.encode(request), headers, timeout_s
            )
        except NobodyServes:
            raise EnvError(
                m.ENV_ERROR_UNKNOWN_ENV,
                f"nobody answers {subject}: is env-gateway running and serving this env "
                "(or did the gateway holding this episode stop)?",
                episode_id,
            ) from None
        except TimeoutError:
            raise EnvError(
                m.ENV_ERROR_TIMEOUT, f"no reply on {subject} within {timeout_s} s", episode_id
            ) from None
        try:
            reply = wire.decode(reply_type, data, reply_headers)
        except wire.InvalidMessage as exc:
            raise EnvError(m.ENV_ERROR_BAD_REQUEST, f"unreadable reply: {exc}", episode_id) from exc
        if reply.error:
            raise EnvError(reply.error, reply.error_message, episode_id)
        return reply
