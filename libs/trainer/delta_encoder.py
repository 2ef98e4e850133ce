"""The trainer's delta encoder, in a process of its own (libs/trainer/staging.py uses it).

Encoding each version in a thread of the trainer doubled byte-0.5b's optimizer step on an
H200, whatever the thread count: the step is launch-bound
Python, and the encode holds the GIL between its numpy and zstd calls. In a process of its
own the encode shares only the cores. The trainer sends each offered copy of its weights
(CUDA tensors travel as IPC handles: the child reads the trainer's memory, nothing is
copied; CPU tensors through shared memory); the child keeps the chain (the last version's
tensors, their host mirror and its hash, `libs.weights.gpu.encode_device`) and writes each
delta into the staging folder, where the trainer announces it to the broadcaster.

    encoder = DeltaEncoder(staging_dir, options)
    digest = await encoder.adopt(state, version)   # a version handed over whole: the base
    delta = await encoder.encode(state, version)   # the next one, as a delta file
    await encoder.close()

The trainer keeps each version's tensors alive while the child may read them (the base of
the next delta). A failed encode drops the chain (adopt again); a dead child raises
`DeltaEncoderError` naming its exit code, and the next request starts a new one (with no
chain: adopt again); a request after close raises too.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch

from libs.child_process import ChildDied, ChildProcess, become_child
from libs.weights.encoder import EncodeOptions, EncodeTimes
from libs.weights.gpu import encode_device
from libs.weights.handoff import write_staged_delta
from libs.weights.hashing import state_hash
from libs.weights.tensors import raw_state

log = structlog.get_logger(__name__)


class DeltaEncoderError(RuntimeError):
    """The delta encoder process failed, died, or was closed."""


@dataclass(frozen=True)
class EncodedDelta:
    """A delta the child wrote into the staging folder."""

    version: int
    base_version: int
    target_hash: str
    file_name: str
    num_bytes: int
    encode_s: float  # the child's encode and write
    diff_s: float  # of which: finding the changes, and their copy to the host


@dataclass
class _Chain:
    """The child's side: the last version sent, the base of the next delta."""

    version: int
    hash: str
    state: dict[str, torch.Tensor]  # the trainer's tensors (IPC views) or shared CPU copies
    mirror: dict[str, torch.Tensor]  # its bytes on the host, patched by each encode
    spare: dict[str, torch.Tensor]  # host buffers the next version is copied into


_Request = tuple[Literal["adopt", "encode"], int, dict[str, torch.Tensor]]


class DeltaEncoder:
    """The parent's handle on the encoder process (started on the first request)."""

    def __init__(self, staging_dir: Path, options: EncodeOptions) -> None:
        self._closed = False
        self._process = ChildProcess(
            _serve, (str(staging_dir), options), name="rlpipe-delta-encoder"
        )

    async def adopt(self, state: dict[str, torch.Tensor], version: int) -> str:
        """Make `version` (already handed over whole) the base of the next delta; returns
        its version hash."""
        digest = await self._call(("adopt", version, state))
        assert isinstance(digest, str)
        return digest

    async def encode(self, state: dict[str, torch.Tensor], version: int) -> EncodedDelta:
        """Write `version` as a delta on the last version adopted or encoded."""
        delta = await self._call(("encode", version, state))
        assert isinstance(delta, EncodedDelta)
        return delta

    async def close(self) -> None:
        """Stop the process (it finishes the request it is on)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._process.close)

    async def _call(self, request: _Request) -> str | EncodedDelta:
        if self._closed:
            raise DeltaEncoderError("the delta encoder is closed")
        if self._process.replace_if_dead():
            log.warning("the delta encoder process died; starting a new one")
        try:
            status, value, detail = await asyncio.to_thread(self._process.call, request)
        except ChildDied as exc:
            raise DeltaEncoderError(f"the delta encoder process died ({exc})") from None
        if status != "ok":
            raise DeltaEncoderError(f"the delta encoder failed: {value}\n{detail}")
        result: str | EncodedDelta = value
        return result


def _serve(
    requests: Any, replies: Any, staging_dir: str, options: EncodeOptions, parent: int
) -> None:
    """The child: adopt and encode versions until told to stop (None) or the trainer dies."""
    become_child(parent)
    chain: _Chain | None = None
    while (request := requests.get()) is not None:
        kind, version, state = request
        try:
            if kind == "adopt":
                chain = _adopt(state, version, options)
                replies.put(("ok", chain.hash, ""))
                continue
            if chain is None:
                raise RuntimeError(f"version {version}: no version adopted to encode against")
            delta, chain = _encode(chain, state, version, Path(staging_dir), options)
            replies.put(("ok", delta, ""))
        except Exception as exc:
            chain = None  # the mirror may be half patched: adopt again
            replies.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        del state, request  # a superseded version's tensors are released at once


def _adopt(state: dict[str, torch.Tensor], version: int, options: EncodeOptions) -> _Chain:
    """The chain from a version handed over whole: its host mirror (pinned for GPU states,
    with a spare pinned buffer per tensor that the next version is copied into) and its hash."""
    on_gpu = any(tensor.is_cuda for tensor in state.values())
    mirror = {
        name: torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu).copy_(t)
        for name, t in state.items()
    }
    spare = {n: torch.empty_like(t, pin_memory=on_gpu) for n, t in mirror.items()} if on_gpu else {}
    return _Chain(version, state_hash(raw_state(mirror), options.threads), state, mirror, spare)


def _encode(
    chain: _Chain,
    state: dict[str, torch.Tensor],
    version: int,
    staging_dir: Path,
    options: EncodeOptions,
) -> tuple[EncodedDelta, _Chain]:
    started, times = time.perf_counter(), EncodeTimes()
    manifest, chunks = encode_device(
        chain.state, state, chain.mirror, base_version=chain.version, version=version,
        options=options, base_hash=chain.hash, spare=chain.spare, times=times,
    )  # fmt: skip
    path = write_staged_delta(staging_dir, manifest, chunks)
    delta = EncodedDelta(
        version=version,
        base_version=chain.version,
        target_hash=manifest.target_hash,
        file_name=path.name,
        num_bytes=path.stat().st_size,
        encode_s=time.perf_counter() - started,
        diff_s=times.diff_s,
    )
    return delta, _Chain(version, manifest.target_hash, state, chain.mirror, chain.spare)
