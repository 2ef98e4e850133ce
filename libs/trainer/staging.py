"""Handing new weights to the weight-broadcaster while the trainer goes on training.

    stager = WeightStager(publisher, staging_dir)
    await stager.offer(state, version, step)   # returns at once; the stager owns `state`
    ...
    await stager.flush()                       # the newest offered version is staged

The trainer offers a copy of its weights on their device (TrainingPrecision.published_copy: a
GPU copy of a 0.5B bf16 state takes about a millisecond), so the next optimizer step may
change the parameters while the copy goes to the host and to the staging file in the
background (libs/weights/handoff.py: file, then
`WeightsStaged`). At most one handover runs; a version offered meanwhile waits in a single
slot, and a newer offer replaces it. So a slow disk or broadcaster makes the trainer publish
less often, never stop, and never queues versions that would be stale by the time they ship:
the broadcaster encodes each version against the last one it announced, so skipped numbers
cost nothing. The newest version offered is always staged in the end.

On a GPU the copy to the host goes through pinned buffers kept from version to version, on
a stream of its own that waits only for the offered copy (not for the training step queued
after it): 1 GB crosses at tens of GB/s instead of the few GB/s of a pageable copy.

A handover that fails (the disk is full, the bus is gone past the ride-through) raises from
the next `offer` or `flush`: the trainer stops loudly rather than training on unpublished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from prometheus_client import Counter

from libs.bus.connection import ride_through
from libs.bus.publisher import Publisher
from libs.trainer.host_memory import HostCopy
from libs.weights.handoff import stage_weights

log = structlog.get_logger(__name__)

SKIPPED = Counter(
    "rlpipe_trainer_versions_not_staged_total",
    "Versions replaced by a newer one before the stager was free",
)


@dataclass
class _Offer:
    state: dict[str, torch.Tensor]
    version: int
    step: int | None
    offered_s: float
    ready: torch.cuda.Event | None  # recorded after the offered copy was queued (GPU states)


class HostBuffers:
    """Pinned host tensors a GPU state is copied into, reused from version to version."""

    def __init__(self) -> None:
        self._host = HostCopy()
        self._stream: torch.cuda.Stream | None = None

    def copy(
        self, state: Mapping[str, torch.Tensor], ready: torch.cuda.Event | None
    ) -> dict[str, torch.Tensor]:
        """`state` on the host: GPU tensors copied into the pinned buffers once `ready` has
        happened (CPU tensors as they are). Blocks until the copies are done."""
        if ready is None:
            return dict(state)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for name, tensor in state.items():
                out[name] = self._host.buffer(name, tensor).copy_(tensor, non_blocking=True)
        self._stream.synchronize()
        return out


class WeightStager:
    """Stages the newest offered version in the background, one handover at a time."""

    def __init__(self, publisher: Publisher, staging_dir: Path) -> None:
        self._publisher = publisher
        self._staging_dir = staging_dir
        self._pending: _Offer | None = None
        self._running: asyncio.Task[None] | None = None
        self._host = HostBuffers()
        self.last_staged_version: int | None = None
        self.num_skipped = 0

    async def offer(
        self, state: Mapping[str, torch.Tensor], version: int, step: int | None = None
    ) -> None:
        """Stage `state` (a copy nobody changes any more) as `version` as soon as the stager
        is free; an offer still waiting is replaced."""
        self._raise_if_failed()
        if self._pending is not None:
            self.num_skipped += 1
            SKIPPED.inc()
            log.debug("version replaced before staging", version=self._pending.version)
        ready = None
        if any(tensor.is_cuda for tensor in state.values()):
            # Everything queued so far (the offered copy) on this thread's stream; the
            # trainer queues its next step only after offer returns.
            ready = torch.cuda.Event()
            ready.record()
        self._pending = _Offer(dict(state), version, step, time.monotonic(), ready)
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._stage_pending(), name="weight-stager")

    async def flush(self) -> None:
        """Wait until every offered version is staged (or replaced); raises a failed handover."""
        while self._running is not None:
            running = self._running
            try:
                await running
            finally:
                if self._running is running:
                    self._running = None

    def _raise_if_failed(self) -> None:
        if self._running is not None and self._running.done():
            running, self._running = self._running, None
            running.result()  # re-raises the handover's error, if any

    async def _stage_pending(self) -> None:
        while self._pending is not None:
            offer, self._pending = self._pending, None
            await self._stage(offer)
            self.last_staged_version = offer.version

    async def _stage(self, offer: _Offer) -> None:
        host = await asyncio.to_thread(self._host.copy, offer.state, offer.ready)
        await ride_through(
            lambda: stage_weights(
                self._publisher,
                self._staging_dir,
                host,
                offer.version,
                step=offer.step,
                offered_s=offer.offered_s,
            ),
            "staging weights",
        )
