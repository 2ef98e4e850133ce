"""Env requests answered in this process, without a bus: the same bytes env-gateway gets,
answered by its own handler (libs.envs.server.EnvHandler: deadlines, errors as replies,
forgetting finished episodes). For measuring a policy on an environment where no services
run (libs.sft.evaluate):

    client = LocalEnvClient({"calc": make_env("calc")})
    runner = AgentRunner(client, tokenizer, generate, runner_settings)

or, for a handler of one's own: `EnvClient(LocalTransport(EnvHandler(envs, limits)))`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from libs.bus import wire
from libs.envs.base import Environment
from libs.envs.client import EnvClient, NobodyServes
from libs.envs.server import EnvHandler, ServerLimits
from proto import messages as m


class LocalTransport:
    """EnvTransport to `handler` in this process: a subject it does not serve has nobody
    serving it, and a request past `timeout_s` times out while the handler finishes it, as
    a gateway on the bus would."""

    def __init__(self, handler: EnvHandler) -> None:
        self.handler = handler
        self._routes = handler.routes()
        self._answering: set[asyncio.Task[m.Message]] = set()  # held until done

    async def request(
        self, subject: str, payload: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[bytes, Mapping[str, str]]:
        if subject not in self._routes:
            raise NobodyServes(subject)
        env, op, _ = self._routes[subject]
        answering = asyncio.create_task(self.handler.answer(env, op, payload, headers))
        self._answering.add(answering)
        answering.add_done_callback(self._answering.discard)
        reply = await asyncio.wait_for(asyncio.shield(answering), timeout=timeout_s)
        return wire.encode(reply), {wire.SCHEMA_HEADER: reply.schema_id()}


class LocalEnvClient(EnvClient):
    """An EnvClient whose requests `handler` answers in this process."""

    def __init__(self, envs: Mapping[str, Environment], limits: ServerLimits | None = None) -> None:
        self.handler = EnvHandler(envs, limits)
        super().__init__(LocalTransport(self.handler))
