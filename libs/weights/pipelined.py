"""Fetch and decode a version overlapped per chunk: each chunk is decoded on a thread as soon
as it is fetched and verified, instead of fetching every chunk and then decoding them all.

The fetch reads on the event loop (one asyncio connection is CPU-bound reading); the decode
threads run zstd, numpy and xxhash, which release the GIL, so on a many-core host the
decode of a large version hides under its fetch and the version is ready about when its
last chunk lands. Nothing is written while chunks arrive: the chunks are prepared (decoded,
every output hash checked, staged on the state's device), and the caller commits them all
once every one passed, as `DeltaApplier.apply_all` would have, so a corrupt or missing
chunk still leaves the state as it was.

    receipt = await fetch_and_prepare(nc, manifest, applier, threads=16)
    applier.commit_all(receipt.prepared, threads=16)   # the writes (the swap pause)
    held = applier.finish()
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from libs.weights.applier import DeltaApplier, PreparedChunk
from libs.weights.format import Chunk, Manifest
from libs.weights.transport import FetchResult, fetch_chunks


@dataclass(frozen=True)
class PipelinedReceipt:
    """The prepared chunks in manifest order, and where the time went: `fetch_s` until the
    last chunk was fetched, `tail_s` the decode left after it (the part not hidden)."""

    prepared: list[PreparedChunk]
    fetch: FetchResult
    fetch_s: float
    tail_s: float

    @property
    def seconds(self) -> float:
        """Fetch and decode together, wall time."""
        return self.fetch_s + self.tail_s


async def fetch_and_prepare(
    nc: Client,
    manifest: Manifest,
    applier: DeltaApplier,
    *,
    threads: int,
    **fetch_options: Any,
) -> PipelinedReceipt:
    """Fetch every chunk of `manifest` (transport.fetch_chunks, with `fetch_options`) and
    prepare each with `applier` on one of `threads` threads as it arrives; raises the first
    fetch or decode error (CorruptDeltaError, MissingChunkError) with nothing written."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    pool = ThreadPoolExecutor(threads, thread_name_prefix="weights-decode")
    futures: dict[int, Future[PreparedChunk]] = {}

    def on_chunk(chunk: Chunk) -> None:  # the payload hash was checked by the fetch
        futures[chunk.header.index] = pool.submit(applier.prepare, chunk, check_payload=False)

    started = time.perf_counter()
    try:
        fetched = await fetch_chunks(nc, manifest, on_chunk=on_chunk, **fetch_options)
        fetch_s = time.perf_counter() - started
        waiting = [asyncio.wrap_future(futures[ref.index]) for ref in manifest.chunks]
        prepared = await asyncio.gather(*waiting)
    finally:
        for future in futures.values():
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
    tail_s = time.perf_counter() - started - fetch_s
    return PipelinedReceipt(list(prepared), fetched, fetch_s, tail_s)
