"""Decoding weight versions in a process of its own, against a host mirror of the weights:
the receiver's decode for live weights on a GPU.

The rollout-worker decodes each version while its engine generates. In one process the
decode threads share the GIL with the worker's event loop and the engine's driver thread:
in the GPU loop with the paged engine (NVIDIA H200, 2026-11-28, py-spy --gil,
bench/results/h200/gpu_loop_paged_profile) the event loop held the GIL 40% of the time and
the chunks' decodes took 4.8 s of wall time for 1.2 s of CPU summed over threads. A child
that read the old values from the GPU itself (CUDA IPC) was freed of the GIL but ran in a
third CUDA context beside the trainer's and the engine's, time-sliced with them: a version's
decode still took 0.27 s (hf) to 0.39 s (paged) median for ~5 MB of delta, about the
interval at which the trainer makes versions, so they queued (same day, H200,
bench/results/h200/gpu_loop_decode_*). Here the child never touches the GPU: it decodes
against a host copy of the weights (the mirror), in shared memory, that it keeps at the
version the worker holds; the worker uploads what a version writes (positions and new bits,
a few MB) in one copy before the pause and scatters it on the device in the pause.

    decoder = DecodeProcess(threads=8)
    timings = decoder.prepare(state, manifest, base, chunks)   # decoded there, nothing written
    held = decoder.commit(manifest)   # the child writes its mirror, this process the state
    decoder.close()

The mirror costs one host copy of the mirrored tensors (the size of the weights; /dev/shm
must hold it: `accepts` says no, and the receiver decodes in its own threads, when it
cannot). It is filled from the state whenever it does not hold the base of the version to
prepare (the first version, after a snapshot the receiver wrote itself, after a failure).
Tensors already in shared memory on the CPU are their own mirror: the child writes them.
Either way a decode against a wrong mirror cannot pass: every chunk's output hash covers
the values it writes.

Errors of the codec (CorruptDeltaError, BaseMismatchError, MissingChunkError) come back as
themselves and leave the state as it was, except in `commit`, where a failure may leave it
half written (the caller holds no known version then). A child that dies raises
DecodeProcessError, a CorruptDeltaError for the same reason; the next call starts a new one.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from libs.child_process import ChildDied, ChildProcess, become_child
from libs.weights.applier import DeltaApplier, PreparedChunks
from libs.weights.errors import CorruptDeltaError, WeightsError
from libs.weights.format import Chunk, Manifest, VersionInfo
from libs.weights.gpu import INT_VIEWS, int_view
from libs.weights.gpu_apply import upload
from libs.weights.tensors import _torch_dtypes

log = structlog.get_logger(__name__)

SHM_PATH = "/dev/shm"
# Room left in /dev/shm beside the mirror (other processes' queues and tensors).
SHM_SPARE_BYTES = 64 << 20


class DecodeProcessError(CorruptDeltaError):
    """The decode process failed outside the codec's checks, or died."""


@dataclass(frozen=True)
class DecodedPiece:
    """What one piece of a version writes into a mirrored tensor: elements [start, stop),
    at `positions` relative to start (None: all of them), as unsigned integer bits."""

    name: str
    start: int
    stop: int
    positions: np.ndarray | None
    values: np.ndarray


@dataclass(frozen=True)
class _StagedWrite:
    """A decoded piece on the state's device: the range's integer view, positions, bits."""

    bits: torch.Tensor
    positions: torch.Tensor | None
    values: torch.Tensor


@dataclass(frozen=True)
class _Staged:
    """The prepared version's writes, staged on the state's devices for `commit`."""

    version: int
    target_hash: str
    writes: list[_StagedWrite]


class _Mirror:
    """Host copies, in one shared-memory buffer, of the state's tensors the child cannot
    write (on a GPU, or in private CPU memory), laid out for one state."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.key = _layout_key(state)
        self.names = [name for name, tensor in state.items() if _needs_mirror(tensor)]
        sizes = [state[name].numel() * state[name].element_size() for name in self.names]
        offsets = np.cumsum([0, *(size + -size % 64 for size in sizes)])  # 64-byte aligned
        self.buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8).share_memory_()
        self.layout = [
            (name, int(offset), state[name].dtype, tuple(state[name].shape))
            for name, offset in zip(self.names, offsets, strict=False)
        ]
        self.tensors = _views(self.buffer, self.layout)
        self.holds: VersionInfo | None = None  # the version the mirror holds, as last known

    def fill(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the mirrored tensors from the state (one device-to-host copy each)."""
        for name in self.names:
            self.tensors[name].copy_(state[name])
        for device in {state[name].device for name in self.names if state[name].is_cuda}:
            torch.cuda.synchronize(device)


class DecodeProcess:
    """The parent's handle on the decode process (started on the first request)."""

    def __init__(self, threads: int = 1) -> None:
        self._lock = threading.Lock()  # one request at a time
        self._mirror: _Mirror | None = None
        self._sent = False  # the child holds the mirror's tensors
        self._staged: _Staged | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._refused_key: tuple[Any, ...] | None = None  # a state whose mirror would not fit
        self._closed = False
        self._process = ChildProcess(_serve, (threads,), name="rlpipe-weight-decoder")

    def accepts(self, state: Mapping[str, Any], manifest: Manifest) -> bool:
        """True when the child can decode `manifest` for `state`: every tensor of the state is
        a contiguous torch tensor, the version writes into the state's tensors, creating or
        removing none (the child could not hand a new tensor back), and /dev/shm holds the
        mirror."""
        tensors = all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in state.values())
        if not (state and tensors and _fits(state, manifest)):
            return False
        return self._mirror_fits(state)

    def prepare(
        self,
        state: Mapping[str, torch.Tensor],
        manifest: Manifest,
        current: VersionInfo,
        chunks: list[Chunk],
    ) -> tuple[float, float]:
        """Decode `chunks` (a delta on `current`, what `state` holds) in the child and stage
        what they write on the state's devices, writing nothing (blocking); returns the
        chunks' decode seconds summed over chunks: wall, CPU (see PreparedChunks)."""
        with self._lock:
            self._staged = None
            self._sync_mirror(state, current)
            wall_s, cpu_s, pieces = self._call(("prepare", manifest, current, chunks))
            writes = self._stage(state, pieces)
            self._staged = _Staged(manifest.version, manifest.target_hash, writes)
            return float(wall_s), float(cpu_s)

    def commit(self, manifest: Manifest) -> VersionInfo:
        """Write the prepared version, which must be `manifest`'s, into the state (blocking):
        the child into its mirror, then this process into the state's device tensors; the
        version the state now holds."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is None:
                raise DecodeProcessError(f"version {manifest.version} to commit was not prepared")
            if (staged.version, staged.target_hash) != (manifest.version, manifest.target_hash):
                raise DecodeProcessError(
                    f"version {manifest.version} to commit, {staged.version} prepared"
                )
            mirror = self._mirror
            assert mirror is not None  # prepared against it
            mirror.holds = None  # mid-write it holds neither version
            held = self._call(("commit", manifest.version, manifest.target_hash))
            assert isinstance(held, VersionInfo)
            self._scatter(staged.writes)
            mirror.holds = held
            return held

    def close(self) -> None:
        """Stop the process (it finishes the request it is on)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._process.close()

    def _mirror_fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether the mirror of this state exists or fits in /dev/shm (logged once if not)."""
        key = _layout_key(state)
        if self._mirror is not None and self._mirror.key == key:
            return True
        if self._refused_key == key:
            return False
        needed = sum(t.numel() * t.element_size() for t in state.values() if _needs_mirror(t))
        free = shutil.disk_usage(SHM_PATH).free if needed else 0
        if self._mirror is not None:
            free += self._mirror.buffer.numel()  # replaced, not added
        if needed and free < needed + SHM_SPARE_BYTES:
            self._refused_key = key
            log.warning(
                "no room in /dev/shm for the weight decoder's mirror; decoding in the worker",
                needed_mb=round(needed / 1e6),
                free_mb=round(free / 1e6),
                fix="give the worker more shared memory (docker: shm_size)",
            )
            return False
        return True

    def _sync_mirror(self, state: Mapping[str, torch.Tensor], current: VersionInfo) -> None:
        """Make the mirror one laid out for `state`, held by the child, at `current`."""
        if self._process.replace_if_dead():
            self._sent = False  # a new child holds nothing
        mirror = self._mirror
        if mirror is None or mirror.key != _layout_key(state):
            self._mirror = mirror = None  # its memory goes before the new one's
            self._sent = False
            mirror = self._mirror = _Mirror(state)
        if not self._sent:
            direct = {name: t for name, t in state.items() if not _needs_mirror(t)}
            self._call(("state", mirror.buffer, mirror.layout, direct))
            self._sent = True
        if mirror.holds != current:
            mirror.fill(state)
            mirror.holds = current

    def _stage(
        self, state: Mapping[str, torch.Tensor], pieces: list[DecodedPiece]
    ) -> list[_StagedWrite]:
        """The pieces on their tensors' devices, one upload per device; waits for it."""
        writes: list[_StagedWrite] = []
        by_device: dict[torch.device, list[DecodedPiece]] = {}
        for piece in pieces:
            by_device.setdefault(state[piece.name].device, []).append(piece)
        for device, group in by_device.items():
            arrays = [a for p in group for a in (p.positions, p.values) if a is not None]
            with self._on_side_stream(device):
                staged = iter(upload(arrays, device))
                for piece in group:
                    bits = int_view(state[piece.name])[piece.start : piece.stop]
                    at = None if piece.positions is None else next(staged).view(torch.int32)
                    values = next(staged).view(INT_VIEWS[piece.values.dtype.itemsize])
                    writes.append(_StagedWrite(bits, at, values))
        return writes

    def _scatter(self, writes: list[_StagedWrite]) -> None:
        """Write the staged pieces into the state's tensors, in place; waits for the devices."""
        for device in {write.bits.device for write in writes}:
            with self._on_side_stream(device):
                for write in (w for w in writes if w.bits.device == device):
                    if write.positions is None:
                        write.bits.copy_(write.values)
                    else:
                        write.bits[write.positions] = write.values

    @contextlib.contextmanager
    def _on_side_stream(self, device: torch.device) -> Iterator[None]:
        """Run on a stream of the decoder's own on a GPU (the engine's kernels on the default
        stream are not waited for), and wait for it on leaving."""
        if device.type != "cuda":
            yield
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def _call(self, request: tuple[Any, ...]) -> Any:
        if self._closed:
            raise DecodeProcessError("the decode process is closed")
        if self._process.replace_if_dead():
            self._sent = False
            raise DecodeProcessError(f"the decode process died before the {request[0]}")
        try:
            status, value, detail = self._process.call(request)
        except ChildDied as exc:
            self._sent = False
            raise DecodeProcessError(f"the decode process died ({exc})") from None
        if status == "ok":
            return value
        if isinstance(value, WeightsError):
            raise value
        raise DecodeProcessError(f"the decode process failed: {value}\n{detail}")


def _needs_mirror(tensor: torch.Tensor) -> bool:
    """A tensor the child cannot write itself: on a GPU, or in this process's own memory."""
    return tensor.is_cuda or not tensor.is_shared()


def _layout_key(state: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return tuple((name, t.data_ptr(), t.dtype, tuple(t.shape)) for name, t in state.items())


def _views(
    buffer: torch.Tensor, layout: list[tuple[str, int, torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """The mirrored tensors as views of the shared buffer."""
    views = {}
    for name, offset, dtype, shape in layout:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        views[name] = buffer[offset : offset + size].view(dtype).view(shape)
    return views


def _serve(requests: Any, replies: Any, threads: int, parent: int) -> None:
    """The child: hold the mirror, prepare versions against it and commit them, until told
    to stop (None) or the parent dies. Never touches a GPU."""
    become_child(parent)
    mirror: dict[str, torch.Tensor] = {}
    mirrored: set[str] = set()  # the tensors whose writes the parent repeats on its device
    prepared: tuple[DeltaApplier, PreparedChunks] | None = None
    while (request := requests.get()) is not None:
        try:
            if request[0] == "state":
                _, buffer, layout, direct = request
                mirror = {**_views(buffer, layout), **direct}
                mirrored = {name for name, _, _, _ in layout}
                prepared = None
                replies.put(("ok", None, ""))
            elif request[0] == "prepare":
                _, manifest, current, chunks = request
                prepared = None
                applier = DeltaApplier(mirror, manifest, current, reuse_whole=True)
                decoded = applier.prepare_all(chunks, threads)
                prepared = applier, decoded
                pieces = _decoded_pieces(chunks, decoded, mirrored)
                replies.put(("ok", (decoded.wall_s, decoded.cpu_s, pieces), ""))
            else:
                replies.put(("ok", _commit(prepared, *request[1:]), ""))
                prepared = None
        except WeightsError as exc:
            replies.put(("error", exc, traceback.format_exc()))
        except Exception as exc:
            replies.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        del request


def _decoded_pieces(
    chunks: list[Chunk], decoded: PreparedChunks, mirrored: set[str]
) -> list[DecodedPiece]:
    """What the prepared chunks write into mirrored tensors (prepare_all keeps the chunks'
    order, and a prepared chunk's writes are its header's pieces in order); positions as
    int32 (a piece is far under 2^31 elements)."""
    pieces = []
    for chunk, prepared in zip(chunks, decoded.chunks, strict=True):
        for piece, (_, written) in zip(chunk.header.pieces, prepared.writes, strict=True):
            if piece.name not in mirrored:
                continue
            positions = written.positions
            if positions is not None:
                positions = positions.astype(np.int32)
            pieces.append(DecodedPiece(piece.name, piece.start, piece.stop, positions,
                                       np.ascontiguousarray(written.values)))  # fmt: skip
    return pieces


def _commit(
    prepared: tuple[DeltaApplier, PreparedChunks] | None, version: int, target_hash: str
) -> VersionInfo:
    """Write the prepared version into the mirror; the version it then holds."""
    if prepared is None:
        raise DecodeProcessError(f"version {version} to commit was not prepared")
    applier, decoded = prepared
    manifest = applier.manifest
    if (manifest.version, manifest.target_hash) != (version, target_hash):
        raise DecodeProcessError(f"version {version} to commit, {manifest.version} prepared")
    for chunk in decoded.chunks:
        applier.commit(chunk)
    return applier.finish()


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
