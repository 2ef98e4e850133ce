"""Decoding weight versions in a process of its own: the receiver's decode for live weights.

The rollout-worker decodes each version while its engine generates. In one process the
decode threads share the GIL with the worker's event loop and the engine's driver thread:
in the GPU loop with the paged engine (NVIDIA H200, 2026-11-28, py-spy --gil,
bench/results/h200/gpu_loop_paged_profile) the event loop held the GIL 40% of the time and
the decode threads 28%, and the chunks' decodes took 4.8 s of wall time for 1.2 s of CPU
summed over threads: a version's decode 0.79 s median, against 0.24 s beside the `hf`
engine, so versions queued behind each other (notify 5.8 s). In a process of its own the
decode shares only the cores.

    decoder = DecodeProcess(threads=8)
    timings = decoder.prepare(state, manifest, base, chunks)   # decoded there, nothing written
    held = decoder.commit(manifest)   # the child writes it into `state`
    decoder.close()

The state's tensors travel once (CUDA tensors as IPC handles, CPU tensors in shared memory:
the child writes the parent's memory, nothing is copied) and again only when the mapping
holds other tensors. The parent keeps them alive (an engine's parameters). `accepts` says
which versions the child can take: into tensors it can write, creating none.

Errors of the codec (CorruptDeltaError, BaseMismatchError, MissingChunkError) come back as
themselves and leave the state as it was, except in `commit`, where a failure may leave it
half written (the caller holds no known version then). A child that dies raises
DecodeProcessError, a CorruptDeltaError for the same reason; the next call starts a new one.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from libs.child_process import ChildDied, ChildProcess, become_child
from libs.weights.applier import PreparedChunks
from libs.weights.errors import CorruptDeltaError, WeightsError
from libs.weights.format import Chunk, Manifest, VersionInfo
from libs.weights.gpu_apply import DeviceDeltaApplier
from libs.weights.tensors import _torch_dtypes


class DecodeProcessError(CorruptDeltaError):
    """The decode process failed outside the codec's checks, or died."""


class DecodeProcess:
    """The parent's handle on the decode process (started on the first request)."""

    def __init__(self, threads: int = 1, new_tensor_kind: str = "auto") -> None:
        self._lock = threading.Lock()  # one request at a time
        self._sent: tuple[tuple[str, int], ...] | None = None  # the state the child holds
        self._closed = False
        self._process = ChildProcess(
            _serve, (threads, new_tensor_kind), name="rlpipe-weight-decoder"
        )

    def accepts(self, state: Mapping[str, Any], manifest: Manifest) -> bool:
        """True when the child can decode `manifest` into `state`: every tensor of the state
        is a contiguous torch tensor on a CUDA device or in shared memory (the child writes
        it in place), and the version writes into the state's tensors, creating or removing
        none (the child could not hand a new tensor back)."""
        shareable = all(
            isinstance(t, torch.Tensor) and (t.is_cuda or t.is_shared()) and t.is_contiguous()
            for t in state.values()
        )
        return bool(state) and shareable and _fits(state, manifest)

    def prepare(
        self,
        state: Mapping[str, torch.Tensor],
        manifest: Manifest,
        current: VersionInfo | None,
        chunks: list[Chunk],
    ) -> tuple[float, float]:
        """Decode `chunks` against `state` in the child without writing (blocking); returns
        the chunks' decode seconds summed over chunks: wall, CPU (see PreparedChunks)."""
        with self._lock:
            self._replace_if_dead()  # a new child holds no state: send it
            key = tuple((name, tensor.data_ptr()) for name, tensor in state.items())
            if key != self._sent:
                self._call(("state", dict(state)))
                self._sent = key
            wall_s, cpu_s = self._call(("prepare", manifest, current, chunks))
            return float(wall_s), float(cpu_s)

    def commit(self, manifest: Manifest) -> VersionInfo:
        """Write the prepared version, which must be `manifest`'s, into the state (blocking);
        the version the state now holds."""
        with self._lock:
            held = self._call(("commit", manifest.version, manifest.target_hash))
            assert isinstance(held, VersionInfo)
            return held

    def close(self) -> None:
        """Stop the process (it finishes the request it is on)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._process.close()

    def _replace_if_dead(self) -> bool:
        """Swap a dead child for a new one, which holds no state yet; True if it did."""
        if self._process.replace_if_dead():
            self._sent = None
            return True
        return False

    def _call(self, request: tuple[Any, ...]) -> Any:
        if self._closed:
            raise DecodeProcessError("the decode process is closed")
        if self._replace_if_dead() and request[0] == "commit":
            raise DecodeProcessError("the decode process died before the commit")
        try:
            status, value, detail = self._process.call(request)
        except ChildDied as exc:
            self._sent = None
            raise DecodeProcessError(f"the decode process died ({exc})") from None
        if status == "ok":
            return value
        if isinstance(value, WeightsError):
            raise value
        raise DecodeProcessError(f"the decode process failed: {value}\n{detail}")


def _serve(requests: Any, replies: Any, threads: int, kind: str, parent: int) -> None:
    """The child: hold a state, prepare versions against it and commit them, until told to
    stop (None) or the parent dies."""
    become_child(parent)
    state: dict[str, torch.Tensor] = {}
    prepared: tuple[DeviceDeltaApplier, PreparedChunks] | None = None
    while (request := requests.get()) is not None:
        try:
            if request[0] == "state":
                state, prepared = request[1], None
                replies.put(("ok", None, ""))
            elif request[0] == "prepare":
                _, manifest, current, chunks = request
                prepared = None
                applier = DeviceDeltaApplier(state, manifest, current, kind, reuse_whole=True)
                decoded = applier.prepare_all(chunks, threads)
                prepared = applier, decoded
                replies.put(("ok", (decoded.wall_s, decoded.cpu_s), ""))
            else:
                _, version, target_hash = request
                if prepared is None:
                    raise DecodeProcessError(f"version {version} to commit was not prepared")
                applier, decoded = prepared
                prepared = None
                if (applier.manifest.version, applier.manifest.target_hash) != (
                    version,
                    target_hash,
                ):
                    raise DecodeProcessError(
                        f"version {version} to commit, {applier.manifest.version} prepared"
                    )
                for chunk in decoded.chunks:
                    applier.commit(chunk)
                replies.put(("ok", applier.finish(), ""))
        except WeightsError as exc:
            replies.put(("error", exc, traceback.format_exc()))
        except Exception as exc:
            replies.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        del request


def _fits(state: Mapping[str, Any], manifest: Manifest) -> bool:
    """True when every tensor of `manifest` is in `state` with its dtype and shape, and the
    manifest removes none."""
    dtypes = _torch_dtypes()
    for entry in manifest.tensors:
        tensor = state.get(entry.name)
        if tensor is None or list(tensor.shape) != list(entry.shape):
            return False
        if dtypes.get(entry.dtype) != tensor.dtype:
            return False
    return not manifest.removed
