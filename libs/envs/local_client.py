"""An EnvClient that serves episodes from environments in this process, without a bus.

The same request handling as env-gateway (libs.envs.server.EnvServer's on_reset/on_step/
on_close: deadlines, errors as replies, forgetting finished episodes), called directly. For
measuring a policy on an environment where no services run (libs.sft.evaluate):

    client = LocalEnvClient({"calc": make_env("calc")})
    runner = AgentRunner(client, tokenizer, generate, runner_settings)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from libs.envs.base import Environment
from libs.envs.client import EnvClient, EnvError
from libs.envs.server import EnvServer, ServerLimits
from proto import messages as m

R = TypeVar("R", bound=m.Message)


class LocalEnvClient(EnvClient):
    """EnvClient whose requests are answered by an EnvServer object in this process."""

    def __init__(self, envs: Mapping[str, Environment], limits: ServerLimits | None = None) -> None:
        super().__init__(nc=None)  # type: ignore[arg-type]  # never used: _request is local
        self.server = EnvServer(None, envs, limits)  # type: ignore[arg-type]

    async def _request(
        self,
        subject: str,
        request: m.Message,
        reply_type: type[R],
        timeout_s: float,
        episode_id: str,
    ) -> R:
        reply: Any
        if isinstance(request, m.EnvResetRequest):
            reply = await self.server.on_reset(request.task.env, request)
        elif isinstance(request, m.EnvStepRequest):
            reply = await self.server.on_step(self._env_of(episode_id), request)
        elif isinstance(request, m.EnvCloseRequest):
            reply = await self.server.on_close(self._env_of(episode_id), request)
        else:
            raise TypeError(f"no local handler for {type(request).__name__}")
        if reply.error:
            raise EnvError(reply.error, reply.error_message, episode_id)
        assert isinstance(reply, reply_type)
        return reply

    def _env_of(self, episode_id: str) -> str:
        held = self.server.episodes.get(episode_id)
        return held.env if held else ""
