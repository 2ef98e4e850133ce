"""Whether a connection is to a region's server, and so which work queue a worker takes.

A region's server holds mirrors of the hub's weight streams (libs/region/setup.py), the hub's
never does: that is what tells them apart, with a look-up every worker may make on either.

    regional = await on_regional_server(bus.js)
    queue = task_queue(regional)      # RL_REGION_TASKS/rollout-worker, or the hub's RL_TASKS
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from proto import streams
from proto.regions import REGION_WORKER_TASKS
from proto.streams import ConsumerSpec


async def on_regional_server(js: JetStreamContext) -> bool:
    """True where the weight chunk stream is a mirror (of a hub's, in another domain)."""
    try:
        info = await js.stream_info(streams.WEIGHT_CHUNKS.name)
    except NotFoundError:
        return False
    return info.config.mirror is not None


def task_queue(regional: bool) -> ConsumerSpec:
    """The consumer a rollout-worker pulls tasks from on its server."""
    return REGION_WORKER_TASKS if regional else streams.ROLLOUT_WORKER_TASKS
