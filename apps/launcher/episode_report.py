"""The demo's learning figures: episodes of the first and last trainer steps, side by side.

At the end of `rlpipe demo` (before NATS stops) the launcher reads every scored rollout from
the bus and the trainer's step samples (`<run>/trainer/step_samples.jsonl`, which name the
samples each step trained on), and reports for the first and the last `window` steps: task
success, mean reward, tool-call validity, and turns, tool calls and segments per episode
(libs.rollout.figures). These become `episodes_first_steps` / `episodes_last_steps` in the
summary line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats.errors
from nats.js import api as js_api

from libs.bus import wire
from libs.bus.connection import NatsOptions, connect_bus
from libs.rollout.figures import episode_figures
from libs.trainer.metrics import latest_per_step, read_step_samples
from proto import streams
from proto.messages import ScoredRollout

REPORT_BATCH = 1000
FETCH_TIMEOUT_S = 5.0


async def read_scored(nats_url: str, options: NatsOptions | None = None) -> list[ScoredRollout]:
    """Every scored rollout on the bus at `nats_url`, in stream order.

    Read in batches through an ephemeral consumer that acks nothing: one `get_msg` per
    message cost a round trip each (~15 s for a 2-minute demo's 14K rollouts on 2 cores)."""
    bus = await connect_bus(nats_url, "launcher-report", max_attempts=2, options=options)
    try:
        name = streams.ROLLOUTS_SCORED.name
        info = await bus.js.stream_info(name)
        if info.state.messages == 0:
            return []
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.ALL,
            ack_policy=js_api.AckPolicy.NONE,
            inactive_threshold=60.0,
        )
        sub = await bus.js.pull_subscribe(
            streams.ROLLOUTS_SCORED.subjects[0],
            stream=name,
            config=config,
            pending_bytes_limit=256 * 1024 * 1024,
        )
        out: list[ScoredRollout] = []
        last_seq = 0
        while last_seq < info.state.last_seq:
            try:
                msgs = await sub.fetch(REPORT_BATCH, timeout=FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                break  # the rest was deleted meanwhile (retention): report what is there
            for msg in msgs:
                last_seq = msg.metadata.sequence.stream
                out.append(wire.decode(ScoredRollout, msg.data or b"", dict(msg.headers or {})))
        return out
    finally:
        await bus.close()


def step_sample_ids(run_dir: Path) -> list[list[str]]:
    """The sample ids each offline trainer step trained on, in step order."""
    records = latest_per_step(read_step_samples(run_dir))
    return [r.sample_ids for r in records if r.stream == "offline"]


def first_last_report(
    steps: Sequence[Sequence[str]], scored: Sequence[ScoredRollout], window: int = 5
) -> dict[str, Any]:
    """Episode figures of the first and last `window` steps (they overlap on a short run)."""
    if not steps:
        return {}
    by_id = {s.rollout.rollout_id: s for s in scored}

    def figures(chosen: Sequence[Sequence[str]]) -> dict[str, Any]:
        found = [by_id[i] for ids in chosen for i in ids if i in by_id]
        return episode_figures(found)

    window = min(window, len(steps))
    return {
        "episode_window_steps": window,
        "episodes_first_steps": figures(steps[:window]),
        "episodes_last_steps": figures(steps[-window:]),
    }


async def episode_report(
    run_dir: Path, nats_url: str, options: NatsOptions | None = None, window: int = 5
) -> dict[str, Any]:
    """`first_last_report` of this run's steps and the bus's scored rollouts (read as the
    user of `options`, the admin on a secured bus)."""
    steps = step_sample_ids(run_dir)
    if not steps:
        return {}
    return first_last_report(steps, await read_scored(nats_url, options), window)
