"""Decoding weight versions in a process of its own, against a host mirror of the weights:
the receiver's decode for live weights on a GPU.

The rollout-worker decodes each version while its engine generates. In one process the
decode threads share the GIL with the worker's event loop and the engine's driver thread,
and beside the paged engine they wait for it most of the time (py-spy --gil). A child that
read the old values from the GPU itself (CUDA IPC) would run in a third CUDA context beside
the trainer's and the engine's, time-sliced with them, and decode about as slowly as the
trainer makes versions.

Here the child never touches the GPU. It decodes against a host copy of the weights (the
mirror, in shared memory) that it keeps at the version the worker holds, and leaves what a
version writes (int32 positions and new bits: 200 MB for the 7% of byte-0.5b's elements an
early step changes) in a staging buffer of shared memory, so only their places cross the
pipe. The worker copies that buffer to the device in one copy before the pause and scatters
it in the pause; the child writes the same values into its mirror meanwhile, and the next
request waits for that. Sending the writes back through the pipe instead would put the
mirror's write inside the pause.

    decoder = DecodeProcess(threads=8)
    timings = decoder.prepare(state, manifest, base, chunks)   # decoded there, nothing written
    held = decoder.commit(manifest)   # this process writes the state, the child its mirror
    decoder.close()

The mirror costs one host copy of the mirrored tensors (the size of the weights) and the
staging buffer what the largest version writes; /dev/shm must hold them (`accepts` says no
when the mirror does not fit, and the receiver decodes in its own threads). The mirror is
filled from the state whenever it does not hold the base of the version to prepare (the
first version, after a snapshot the receiver wrote itself, after a failure). Tensors
already in shared memory on the CPU are their own mirror: the child writes them, and
`commit` waits for it. A decode against a wrong mirror cannot pass: every chunk's output
hash covers the values it writes.

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
from libs.weights.applier import DeltaApplier, PreparedChunks, map_on_threads
from libs.weights.encodings import Written
from libs.weights.errors import CorruptDeltaError, MissingChunkError, WeightsError
from libs.weights.format import Chunk, Manifest, PieceHeader, VersionInfo
from libs.weights.gpu import INT_VIEWS, int_view
from libs.weights.tensors import _torch_dtypes

log = structlog.get_logger(__name__)

SHM_PATH = "/dev/shm"
# Room left in /dev/shm beside the mirror (other processes' queues and tensors).
SHM_SPARE_BYTES = 64 << 20
ALIGN_BYTES = 64  # of every array in the shared buffers (any element type views it)


class DecodeProcessError(CorruptDeltaError):
    """The decode process failed outside the codec's checks, or died."""


@dataclass(frozen=True)
class StagedPiece:
    """Where the child left what one piece writes into a mirrored tensor, in the staging
    buffer: elements [start, stop) of tensor `name`, at `count` int32 positions relative to
    start from byte `positions_at` (-1: every element of the range, in order), new bits of
    `width` bytes each from byte `values_at`."""

    name: str
    start: int
    stop: int
    positions_at: int
    count: int
    values_at: int
    width: int

    @property
    def end(self) -> int:
        """The staging byte after this piece's values."""
        return self.values_at + self.count * self.width


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
        self.direct = {name: t for name, t in state.items() if not _needs_mirror(t)}
        offsets = np.cumsum([0, *(_aligned(state[name].nbytes) for name in self.names)])
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
        self._staging: torch.Tensor | None = None  # the child's staging buffer, mapped here
        self._sent = False  # the child holds the mirror's tensors
        self._staged: _Staged | None = None
        self._committing: VersionInfo | None = None  # a commit sent, its answer not read
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
            try:
                self._settle()
            except WeightsError as exc:  # the mirror is filled again below
                log.warning("the weight decoder's mirror write failed", error=str(exc)[:300])
            self._sync_mirror(state, current)
            wall_s, cpu_s, pieces, staging = self._call(("prepare", manifest, current, chunks))
            if staging is not None:
                self._staging = staging
            writes = self._stage(state, pieces)
            self._staged = _Staged(manifest.version, manifest.target_hash, writes)
            return float(wall_s), float(cpu_s)

    def commit(self, manifest: Manifest) -> VersionInfo:
        """Write the prepared version, which must be `manifest`'s, into the state (blocking),
        while the child writes it into its mirror; the version the state now holds."""
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
            self._send(("commit", manifest.version, manifest.target_hash))
            held = VersionInfo(version=manifest.version, hash=manifest.target_hash)
            self._committing = held  # the answer is read by the next request
            self._scatter(staged.writes)
            if mirror.direct:  # tensors of the state itself: written once the child answers
                self._settle()
            return held

    def close(self) -> None:
        """Stop the process (it finishes the request it is on)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._process.close()

    def _settle(self) -> None:
        """Read the answer to a commit sent: the mirror then holds its version."""
        if self._committing is None:
            return
        held, self._committing = self._committing, None
        answer = self._receive()
        assert answer == held, f"the child committed {answer}, not {held}"
        assert self._mirror is not None
        self._mirror.holds = held

    def _mirror_fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether the mirror of this state exists or fits in /dev/shm (logged once if not)."""
        key = _layout_key(state)
        if self._mirror is not None and self._mirror.key == key:
            return True
        if self._refused_key == key:
            return False
        needed = sum(t.nbytes for t in state.values() if _needs_mirror(t))
        replaced = self._mirror.buffer.numel() if self._mirror is not None else 0
        free = _shm_free_bytes() + replaced if needed else 0
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
            self._call(("state", mirror.buffer, mirror.layout, mirror.direct))
            self._sent = True
        if mirror.holds != current:
            mirror.fill(state)
            mirror.holds = current

    def _stage(
        self, state: Mapping[str, torch.Tensor], pieces: list[StagedPiece]
    ) -> list[_StagedWrite]:
        """The pieces on their tensors' devices: the staging buffer in one copy per device."""
        if not pieces:
            return []
        assert self._staging is not None  # sent with the first pieces
        writes: list[_StagedWrite] = []
        devices = {state[piece.name].device for piece in pieces}
        for device in devices:
            mine = [piece for piece in pieces if state[piece.name].device == device]
            used = max(piece.end for piece in mine)
            with self._on_side_stream(device):
                data = self._staging[:used].to(device, non_blocking=True)
            for piece in mine:
                writes.append(_staged_write(state[piece.name], piece, data))
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
        self._send(request)
        return self._receive()

    def _send(self, request: tuple[Any, ...]) -> None:
        if self._closed:
            raise DecodeProcessError("the decode process is closed")
        if self._process.replace_if_dead():
            self._sent = False
            raise DecodeProcessError(f"the decode process died before the {request[0]}")
        self._process.send(request)

    def _receive(self) -> Any:
        try:
            status, value, detail = self._process.reply()
        except ChildDied as exc:
            self._sent = False
            raise DecodeProcessError(f"the decode process died ({exc})") from None
        if status == "ok":
            return value
        if isinstance(value, WeightsError):
            raise value
        raise DecodeProcessError(f"the decode process failed: {value}\n{detail}")


def _staged_write(tensor: torch.Tensor, piece: StagedPiece, data: torch.Tensor) -> _StagedWrite:
    """One piece's write, its positions and bits viewed in the staged copy `data`."""
    bits = int_view(tensor)[piece.start : piece.stop]
    positions = None
    if piece.positions_at >= 0:
        positions = data[piece.positions_at : piece.positions_at + 4 * piece.count]
        positions = positions.view(torch.int32)
    values = data[piece.values_at : piece.end].view(INT_VIEWS[piece.width])
    return _StagedWrite(bits, positions, values)


def _needs_mirror(tensor: torch.Tensor) -> bool:
    """A tensor the child cannot write itself: on a GPU, or in this process's own memory."""
    return tensor.is_cuda or not tensor.is_shared()


def _shm_free_bytes() -> int:
    """Bytes /dev/shm can still hold (a full one fails writes with SIGBUS, not an error)."""
    return shutil.disk_usage(SHM_PATH).free


def _layout_key(state: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return tuple((name, t.data_ptr(), t.dtype, tuple(t.shape)) for name, t in state.items())


def _aligned(size: int) -> int:
    return size + -size % ALIGN_BYTES


def _views(
    buffer: torch.Tensor, layout: list[tuple[str, int, torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """The mirrored tensors as views of the shared buffer."""
    views = {}
    for name, offset, dtype, shape in layout:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        views[name] = buffer[offset : offset + size].view(dtype).view(shape)
    return views


def _serve(requests: Any, replies: Any, threads: int, parent: int) -> None:
    """The child: hold the mirror, prepare versions against it and commit them, until told
    to stop (None) or the parent dies. Never touches a GPU."""
    become_child(parent)
    child = _Child(threads)
    while (request := requests.get()) is not None:
        try:
            replies.put(("ok", child.handle(request), ""))
        except WeightsError as exc:
            replies.put(("error", exc, traceback.format_exc()))
        except Exception as exc:
            replies.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        del request


class _Child:
    """The decode process's side: the mirror, the staging buffer, the version prepared."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.mirror: dict[str, torch.Tensor] = {}
        self.mirrored: set[str] = set()  # the tensors whose writes the parent makes too
        self.staging: torch.Tensor | None = None
        self.prepared: tuple[DeltaApplier, PreparedChunks] | None = None

    def handle(self, request: tuple[Any, ...]) -> Any:
        kind, *args = request
        if kind == "state":
            return self.hold(*args)
        if kind == "prepare":
            return self.prepare(*args)
        return self.commit(*args)

    def hold(self, buffer: torch.Tensor, layout: list[Any], direct: dict[str, Any]) -> None:
        self.mirror = {**_views(buffer, layout), **direct}
        self.mirrored = {name for name, _, _, _ in layout}
        self.prepared = None

    def prepare(
        self, manifest: Manifest, current: VersionInfo, chunks: list[Chunk]
    ) -> tuple[float, float, list[StagedPiece], torch.Tensor | None]:
        """Decode the version against the mirror and stage what it writes into mirrored
        tensors; the decode's timings, the staged pieces and a new staging buffer if it
        had to grow (None: the one sent before)."""
        self.prepared = None
        applier = DeltaApplier(self.mirror, manifest, current, reuse_whole=True)
        decoded = applier.prepare_all(chunks, self.threads)
        missing = {ref.index for ref in manifest.chunks} - {c.index for c in decoded.chunks}
        if missing:
            raise MissingChunkError(f"{len(missing)} chunk(s) not sent, first: {min(missing)}")
        writes = [
            (piece, written)
            for chunk, prepared in zip(chunks, decoded.chunks, strict=True)
            for piece, (_, written) in zip(chunk.header.pieces, prepared.writes, strict=True)
            if piece.name in self.mirrored
        ]
        pieces, needed = _staging_layout(writes)
        grown = self._reserve(needed)
        self._copy_out(writes, pieces)
        self.prepared = applier, decoded
        return decoded.wall_s, decoded.cpu_s, pieces, grown

    def _reserve(self, needed: int) -> torch.Tensor | None:
        """A staging buffer of at least `needed` bytes: the one held, or a new one."""
        if self.staging is not None and self.staging.numel() >= needed:
            return None
        size = max(needed + needed // 4, 1 << 20)
        self.staging = None  # freed before the next is made
        free = _shm_free_bytes()
        if free < size + SHM_SPARE_BYTES:
            raise DecodeProcessError(
                f"no room in {SHM_PATH} for {size / 1e6:.0f} MB of decoded writes "
                f"({free / 1e6:.0f} MB free)"
            )
        self.staging = torch.empty(size, dtype=torch.uint8).share_memory_()
        return self.staging

    def _copy_out(
        self, writes: list[tuple[PieceHeader, Written]], pieces: list[StagedPiece]
    ) -> None:
        """Write the pieces' positions (as int32) and bits into the staging buffer."""
        assert self.staging is not None or not pieces
        buffer = self.staging.numpy() if self.staging is not None else np.empty(0, np.uint8)

        def copy(job: tuple[tuple[PieceHeader, Written], StagedPiece]) -> None:
            (_, written), piece = job
            if written.positions is not None:
                at = buffer[piece.positions_at : piece.positions_at + 4 * piece.count]
                np.copyto(at.view(np.int32), written.positions, casting="unsafe")
            values = np.ascontiguousarray(written.values).reshape(-1).view(np.uint8)
            buffer[piece.values_at : piece.end] = values

        map_on_threads(copy, list(zip(writes, pieces, strict=True)), self.threads)

    def commit(self, version: int, target_hash: str) -> VersionInfo:
        """Write the prepared version into the mirror; the version it then holds."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            raise DecodeProcessError(f"version {version} to commit was not prepared")
        applier, decoded = prepared
        manifest = applier.manifest
        if (manifest.version, manifest.target_hash) != (version, target_hash):
            raise DecodeProcessError(f"version {version} to commit, {manifest.version} prepared")
        applier.commit_all(decoded.chunks, self.threads)
        return applier.finish()


def _staging_layout(writes: list[tuple[PieceHeader, Written]]) -> tuple[list[StagedPiece], int]:
    """Where each write goes in the staging buffer, and the bytes needed; positions as
    int32 (a piece is far under 2^31 elements)."""
    pieces, at = [], 0
    for header, written in writes:
        assert header.stop - header.start < 2**31, "a piece too long for int32 positions"
        count, width = int(written.values.size), int(written.values.dtype.itemsize)
        positions_at = -1
        if written.positions is not None:
            positions_at, at = at, at + _aligned(4 * count)
        pieces.append(
            StagedPiece(header.name, header.start, header.stop, positions_at, count, at, width)
        )
        at += _aligned(count * width)
    return pieces, at


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
