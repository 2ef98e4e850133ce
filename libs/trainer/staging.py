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
the next `offer`, `flush` or `raise_if_failed` (the trainer calls it while it waits for
samples: the workers' samples may be waiting for that very version): the trainer stops
loudly rather than training on unpublished, or waiting forever.

With `deltas=True` (the trainer's `weight_handover`, by default where its weights are on a
GPU) each version after the first is encoded against the version handed over before, by a
process of the trainer's own (libs/trainer/delta_encoder.py): the two bf16 copies are
compared on the device, only the changed values (and tensors dense with changes) cross to
the host, where a host mirror of the last version is patched and hashed, and the
broadcaster gets a delta file instead of the whole state. The stager keeps the last
version's device copy (the size of the published weights: the process reads it); the
process holds the host mirror (twice the published weights, pinned, on a GPU). The first
version goes whole, and so does the next one whenever the broadcaster's chain is not where
the trainer's delta would start: nothing staged is waiting and the last version announced is
not the last one handed over (the broadcaster refused a delta, or lost its chain); its chain
then continues from it.
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
from libs.cuda_device import cuda_device_of, recorded_event
from libs.trainer.delta_encoder import DeltaEncoder, DeltaEncoderError
from libs.trainer.host_memory import HostCopy
from libs.weights.announcements import announced_head
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import announce_staged_delta, stage_weights
from proto import streams

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


@dataclass
class _Chain:
    """The last version handed over, the base of the next delta."""

    version: int
    hash: str
    state: dict[str, torch.Tensor]  # the offered copy: the encoder process reads it


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
        if self._stream is None:  # on the state's card, not this thread's current one
            self._stream = torch.cuda.Stream(cuda_device_of(state.values()))
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for name, tensor in state.items():
                out[name] = self._host.buffer(name, tensor).copy_(tensor, non_blocking=True)
        self._stream.synchronize()
        return out


class WeightStager:
    """Stages the newest offered version in the background, one handover at a time."""

    def __init__(
        self,
        publisher: Publisher,
        staging_dir: Path,
        *,
        deltas: bool = False,
        options: EncodeOptions | None = None,
    ) -> None:
        """`deltas`: encode versions after the first here (see the module docstring), with
        `options` (chunks must fit the bus's max payload)."""
        self._publisher = publisher
        self._staging_dir = staging_dir
        self._pending: _Offer | None = None
        self._running: asyncio.Task[None] | None = None
        self._host = HostBuffers()
        self._encoder = DeltaEncoder(staging_dir, options or EncodeOptions()) if deltas else None
        self._chain: _Chain | None = None
        self.last_staged_version: int | None = None
        self.num_skipped = 0

    async def offer(
        self, state: Mapping[str, torch.Tensor], version: int, step: int | None = None
    ) -> None:
        """Stage `state` (a copy nobody changes any more) as `version` as soon as the stager
        is free; an offer still waiting is replaced."""
        self.raise_if_failed()
        if self._pending is not None:
            self.num_skipped += 1
            SKIPPED.inc()
            log.debug("version replaced before staging", version=self._pending.version)
        ready = None
        device = cuda_device_of(state.values())
        if device is not None:
            # Everything queued so far (the offered copy) on this thread's stream of the
            # state's card; the trainer queues its next step only after offer returns.
            ready = recorded_event(device)
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

    def raise_if_failed(self) -> None:
        """Re-raise the error of a handover that failed (once: the stager is then idle)."""
        if self._running is not None and self._running.done():
            running, self._running = self._running, None
            running.result()  # re-raises the handover's error, if any

    async def _stage_pending(self) -> None:
        while self._pending is not None:
            offer, self._pending = self._pending, None
            await self._stage(offer)
            self.last_staged_version = offer.version

    async def close(self) -> None:
        """Stage what was offered, then stop the delta encoder's process (if one runs)."""
        try:
            await self.flush()
        finally:
            if self._encoder is not None:
                await self._encoder.close()

    async def _stage(self, offer: _Offer) -> None:
        chain, self._chain = self._chain, None  # until this handover is done
        if chain is not None and await ride_through(
            lambda: self._continues(chain), "checking the weight chain"
        ):
            try:
                await self._stage_delta(chain, offer)
                return
            except DeltaEncoderError as exc:  # the version goes whole; the chain restarts
                log.error("delta encode failed: the version goes whole", error=str(exc))
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
        if self._encoder is not None:
            digest = await self._encoder.adopt(offer.state, offer.version)
            self._chain = _Chain(offer.version, digest, offer.state)

    async def _continues(self, chain: _Chain) -> bool:
        """False when the broadcaster's chain cannot take a delta on `chain` (see the module
        docstring); True while staged versions are still waiting, or the head is the chain's."""
        js = self._publisher.js
        waiting = (await js.stream_info(streams.WEIGHTS_STAGED.name)).state.messages
        if waiting:
            return True
        head = await announced_head(js)
        if head is not None and (head.version, head.version_hash) == (chain.version, chain.hash):
            return True
        log.warning(
            "the broadcaster's chain is not the trainer's: the next version goes whole",
            handed_over=chain.version, announced=None if head is None else head.version,
        )  # fmt: skip
        return False

    async def _stage_delta(self, chain: _Chain, offer: _Offer) -> None:
        assert self._encoder is not None  # a chain exists only with one
        started = time.monotonic()
        if offer.ready is not None:  # the child reads the copy: it must be complete
            await asyncio.to_thread(offer.ready.synchronize)
        delta = await self._encoder.encode(offer.state, offer.version)
        encode_s = time.monotonic() - started
        await ride_through(
            lambda: announce_staged_delta(
                self._publisher, self._staging_dir, delta.version, delta.base_version,
                step=offer.step, offered_s=offer.offered_s, encode_s=encode_s,
                diff_s=delta.diff_s,
            ),
            "staging weights",
        )  # fmt: skip
        # Kept: the child reads these tensors as the next delta's base.
        self._chain = _Chain(offer.version, delta.target_hash, offer.state)
