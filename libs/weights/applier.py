"""Apply a delta (or snapshot) to a model: in place chunk by chunk, or into a new state.

`DeltaApplier(state, manifest, current)` first refuses a manifest of another format version
or hash (CorruptDeltaError) and one whose base is not the version the receiver holds
(BaseMismatchError), then `apply(chunk)` checks the chunk belongs to this manifest, checks
its payload hash, decodes it, checks its output hash and only then writes the changed
elements; a chunk that fails a check writes nothing and raises CorruptDeltaError.
`finish()` raises MissingChunkError unless every chunk was applied, drops removed tensors
and, with `verify_full=True`, rehashes the whole result against the manifest's target hash.
Chunks touch disjoint elements, so `apply` may run concurrently.

`apply` is `commit(prepare(chunk))`: `prepare` only reads the state (decode, verify), so a
live model can keep serving while it runs; `commit` writes the changed elements. Tensors the
target adds are inserted into the state by `finish`. With `reuse_whole=True`, a whole tensor
(a snapshot's) whose name, dtype and shape match a tensor of the state is written into it
in place instead of replacing it, so a model's parameters take a snapshot too.

`decode(base, manifest, chunks)` does the same into a copy of the base.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from libs.weights.encodings import (
    Written,
    decode_piece,
    decompress,
    hash_written,
    piece_positions,
)
from libs.weights.errors import BaseMismatchError, CorruptDeltaError, MissingChunkError
from libs.weights.format import (
    Chunk,
    Encoding,
    Manifest,
    TensorEntry,
    VersionInfo,
    check_format,
)
from libs.weights.hashing import digest, new_hasher, state_hash
from libs.weights.targets import CpuRange
from libs.weights.tensors import RawTensor, State, as_raw, empty_raw, kind_of, like_kind, raw_state

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class PreparedChunk:
    """A verified, decoded chunk: where to write what (see `DeltaApplier.prepare`)."""

    index: int
    writes: list[tuple[CpuRange, Any]]  # (target range, Written) per piece

    @property
    def num_written(self) -> int:
        """Elements this chunk writes."""
        return sum(t.size if w.positions is None else int(w.positions.size) for t, w in self.writes)


@dataclass(frozen=True)
class PreparedChunks:
    """The prepared chunks of a version, with the seconds their decodes took summed over
    chunks: wall time, and CPU time of the threads that ran them (wall well above CPU: the
    decode waited, for the GIL or a lock)."""

    chunks: list[PreparedChunk]
    wall_s: float
    cpu_s: float


class DeltaApplier:
    """Applies the chunks of one manifest to a mutable CPU state (numpy or torch) in place."""

    def __init__(
        self,
        state: MutableMapping[str, Any],
        manifest: Manifest,
        current: VersionInfo | None = None,
        kind: str = "auto",
        *,
        reuse_whole: bool = False,
    ) -> None:
        """Check the base and prepare new tensors. `current` is what the receiver holds (None:
        hash the state now); `kind` is the type of new tensors ('auto' follows the state)."""
        check_format(manifest)
        self.state = state
        self.manifest = manifest
        if not manifest.is_snapshot:
            _check_base(state, manifest, current)
        self._kind = _output_kind(state, kind)
        self._reuse_whole = reuse_whole
        self._added: dict[str, Any] = {}  # new tensors, inserted into the state by finish()
        self._raw: dict[str, RawTensor] = {}
        self._refs = {ref.index: ref for ref in manifest.chunks}
        self._pending = set(self._refs)
        self._lock = threading.Lock()
        for entry in manifest.tensors:
            self._raw[entry.name] = self._prepare(entry)

    def _prepare(self, entry: TensorEntry) -> RawTensor:
        """The RawTensor that receives this entry: the state's own, or a new one."""
        if entry.change != "whole":
            if entry.name not in self.state:
                raise BaseMismatchError(
                    f"the base lacks tensor {entry.name!r} that the delta patches"
                )
            raw = as_raw(self.state[entry.name])
            if raw.dtype != entry.dtype or list(raw.shape) != entry.shape:
                raise BaseMismatchError(
                    f"tensor {entry.name!r} is {raw.dtype}{list(raw.shape)} in the base, "
                    f"the delta expects {entry.dtype}{entry.shape}"
                )
            return raw
        if self._reuse_whole and entry.name in self.state:
            raw = as_raw(self.state[entry.name])
            if raw.dtype == entry.dtype and list(raw.shape) == entry.shape:
                if not raw.data.flags.writeable:
                    raise ValueError(f"tensor {entry.name!r} is read-only; cannot write in place")
                return raw
        tensor = like_kind(empty_raw(entry.dtype, tuple(entry.shape)), self._kind)
        self._added[entry.name] = tensor
        return as_raw(tensor)

    def apply(self, chunk: Chunk, *, check_payload: bool = True) -> None:
        """Verify one chunk and write its changes; raises CorruptDeltaError without writing."""
        self.commit(self.prepare(chunk, check_payload=check_payload))

    def prepare(self, chunk: Chunk, *, check_payload: bool = True) -> PreparedChunk:
        """Verify and decode one chunk without writing (reads the state only).

        `check_payload=False` skips rehashing the payload when the caller already checked it
        against the manifest (the transport does, on fetch); the output hash is always checked.
        """
        header = self._check_header(chunk, check_payload)
        try:
            streams = _split_payload(chunk)
        except ValueError as exc:  # stream lists of different lengths
            raise CorruptDeltaError(f"chunk {header.index}: inconsistent header: {exc}") from exc
        ranges = [self._range(piece.name, piece.start, piece.stop) for piece in header.pieces]
        positions = [
            _decoding(header.index, piece.name, piece_positions,
                      piece.encoding, raw, target.size, piece.num_changed)
            for piece, raw, target in zip(header.pieces, streams, ranges, strict=True)
        ]  # fmt: skip
        encodings = [piece.encoding for piece in header.pieces]
        targets = self._read_targets(ranges, positions, encodings, streams)
        hasher = new_hasher()
        writes = []
        for piece, raw, target, at in zip(header.pieces, streams, targets, positions, strict=True):
            written = _decoding(header.index, piece.name, self._decode_piece,
                                piece.encoding, raw, target, piece.num_changed, at)  # fmt: skip
            hash_written(hasher, piece.name, piece.start, written)
            writes.append((target, written))
        if hasher.digest().hex() != header.output_hash:
            raise CorruptDeltaError(
                f"chunk {header.index}: decoded bytes do not match its output hash"
            )
        return self._prepared(header.index, writes)

    def _read_targets(
        self,
        ranges: list[Any],
        positions: list[np.ndarray | None],
        encodings: list[str],
        streams: list[list[np.ndarray]],
    ) -> list[Any]:
        """The ranges the chunk's pieces decode against (a subclass may read ahead, or
        decode pieces from their `streams` itself)."""
        return ranges

    def _decode_piece(
        self,
        encoding: Encoding,
        raw: list[np.ndarray],
        target: Any,
        num_changed: int,
        positions: np.ndarray | None,
    ) -> Written:
        """What one piece writes into `target` (a subclass may decode on its device)."""
        return decode_piece(encoding, raw, target, num_changed, positions)

    def _prepared(self, index: int, writes: list[tuple[Any, Any]]) -> PreparedChunk:
        """The prepared chunk from its decoded writes (a subclass may stage them)."""
        return PreparedChunk(index, writes)

    def commit(self, prepared: PreparedChunk) -> None:
        """Write a prepared chunk's changes into the state."""
        with self._lock:
            if prepared.index not in self._pending:
                raise MissingChunkError(f"chunk {prepared.index} was already applied")
            self._pending.discard(prepared.index)
        for target, written in prepared.writes:
            if written.positions is None:
                target.write_all(written.values)
            else:
                target.scatter(written.positions, written.values)

    def _check_header(self, chunk: Chunk, check_payload: bool = True) -> Any:
        header = chunk.header
        manifest = self.manifest
        if header.format_version != manifest.format_version:
            raise CorruptDeltaError(
                f"chunk {header.index} has format {header.format_version}, "
                f"manifest {manifest.format_version}"
            )
        if header.target_hash != manifest.target_hash or header.version != manifest.version:
            raise CorruptDeltaError(
                f"chunk {header.index} belongs to version {header.version} "
                f"({header.target_hash[:12]}), not {manifest.version} ({manifest.target_hash[:12]})"
            )
        if header.base_version != manifest.base_version:
            raise CorruptDeltaError(
                f"chunk {header.index} has base {header.base_version}, "
                f"manifest {manifest.base_version}"
            )
        with self._lock:
            if header.index not in self._pending:
                raise MissingChunkError(
                    f"chunk {header.index} is not pending (unknown or applied twice)"
                )
        if check_payload and digest(chunk.payload).hex() != header.payload_hash:
            raise CorruptDeltaError(f"chunk {header.index}: payload does not match its hash")
        if self._refs[header.index].payload_hash != header.payload_hash:
            raise CorruptDeltaError(
                f"chunk {header.index}: payload hash differs from the manifest's"
            )
        return header

    def _range(self, name: str, start: int, stop: int) -> CpuRange:
        raw = self._raw.get(name)
        if raw is None or not 0 <= start < stop <= raw.numel:
            raise CorruptDeltaError(f"chunk piece {name!r}[{start}:{stop}] is not in the manifest")
        return CpuRange(raw.units()[start:stop])

    def prepare_all(self, chunks: list[Chunk], threads: int = 1) -> PreparedChunks:
        """`prepare` every chunk (their payloads already checked), on `threads` threads."""

        def timed(chunk: Chunk) -> tuple[PreparedChunk, float, float]:
            wall_s, cpu_s = time.perf_counter(), time.thread_time()
            prepared = self.prepare(chunk, check_payload=False)
            return prepared, time.perf_counter() - wall_s, time.thread_time() - cpu_s

        results = map_on_threads(timed, chunks, threads)
        return PreparedChunks(
            [prepared for prepared, _, _ in results],
            wall_s=sum(wall_s for _, wall_s, _ in results),
            cpu_s=sum(cpu_s for _, _, cpu_s in results),
        )

    def apply_all(self, chunks: Iterable[Chunk], threads: int = 1) -> None:
        """Apply many chunks, on `threads` threads."""
        map_on_threads(self.apply, list(chunks), threads)

    def commit_all(self, prepared: list[PreparedChunk], threads: int = 1) -> None:
        """`commit` every prepared chunk (they touch disjoint elements), on `threads` threads."""
        map_on_threads(self.commit, prepared, threads)

    def finish(self, verify_full: bool = False, threads: int = 1) -> VersionInfo:
        """Check completeness, drop removed tensors, optionally rehash; returns the new version."""
        if self._pending:
            missing = sorted(self._pending)
            raise MissingChunkError(f"{len(missing)} chunk(s) not applied, first: {missing[:5]}")
        self.state.update(self._added)
        self._added = {}
        for name in self.manifest.removed:
            self.state.pop(name, None)
        if verify_full:
            got = state_hash({e.name: self._raw[e.name] for e in self.manifest.tensors}, threads)
            if got != self.manifest.target_hash:
                raise CorruptDeltaError(
                    "the applied state does not match the manifest's target hash"
                )
        return VersionInfo(version=self.manifest.version, hash=self.manifest.target_hash)


def map_on_threads(work: Callable[[T], R], items: list[T], threads: int) -> list[R]:
    """`work` on every item, in order, on up to `threads` threads (in this one for one)."""
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(threads, len(items))) as pool:
            return list(pool.map(work, items))
    return [work(item) for item in items]


def _decoding(index: int, name: str, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, with a piece that does not decode reported as CorruptDeltaError."""
    try:
        return work(*args)
    except (ValueError, IndexError) as exc:
        raise CorruptDeltaError(f"chunk {index}: piece {name!r} does not decode: {exc}") from exc


def _check_base(
    state: MutableMapping[str, Any], manifest: Manifest, current: VersionInfo | None
) -> None:
    """Raise BaseMismatchError unless the receiver holds the manifest's base version."""
    if current is None:
        current = VersionInfo(version=None, hash=state_hash(raw_state(state)))
    if current.version is not None and current.version != manifest.base_version:
        raise BaseMismatchError(
            f"delta is against version {manifest.base_version}, receiver holds {current.version}"
        )
    if current.hash != manifest.base_hash:
        raise BaseMismatchError(
            f"delta is against base hash {manifest.base_hash}, receiver holds {current.hash} "
            f"(version {current.version if current.version is not None else 'unknown'})"
        )


def _split_payload(chunk: Chunk) -> list[list[np.ndarray]]:
    """Decompressed streams of each piece of a chunk, checking the sizes add up."""
    header = chunk.header
    payload = memoryview(chunk.payload)  # stored streams are decoded as views of it: no copy
    if sum(sum(p.stream_sizes) for p in header.pieces) != len(payload):
        raise CorruptDeltaError(f"chunk {header.index}: payload size differs from its header")
    out, at = [], 0
    for piece in header.pieces:
        if len(piece.stream_sizes) != len(piece.raw_sizes):
            raise CorruptDeltaError(f"chunk {header.index}: stream size lists differ in length")
        streams = []
        for size, raw_size in zip(piece.stream_sizes, piece.raw_sizes, strict=True):
            streams.append(decompress(payload[at : at + size], raw_size))
            at += size
        out.append(streams)
    return out


def _output_kind(state: MutableMapping[str, Any], kind: str) -> str:
    if kind != "auto":
        return kind
    first = next(iter(state.values()), None)
    return "torch" if first is None else kind_of(first)


def decode(
    base: State,
    manifest: Manifest,
    chunks: Iterable[Chunk],
    *,
    current: VersionInfo | None = None,
    kind: str = "auto",
    threads: int = 1,
    verify_full: bool = False,
) -> dict[str, Any]:
    """The target version as a new state (the base is left untouched), in manifest order."""
    needed = {e.name for e in manifest.tensors if e.change != "whole"}
    if not manifest.is_snapshot and current is None:
        current = VersionInfo(version=None, hash=state_hash(raw_state(base), threads))
    kind = _output_kind(dict(base), kind) if kind == "auto" else kind
    copy: dict[str, Any] = {}
    for name in needed:
        if name not in base:
            raise BaseMismatchError(f"the base lacks tensor {name!r} that the delta patches")
        copy[name] = _copied(base[name])
    applier = DeltaApplier(copy, manifest, current, kind)
    applier.apply_all(chunks, threads)
    applier.finish(verify_full, threads)
    return {e.name: copy[e.name] for e in manifest.tensors}


def _copied(tensor: Any) -> Any:
    if hasattr(tensor, "clone"):
        return tensor.detach().clone()
    if isinstance(tensor, RawTensor):
        return RawTensor(tensor.dtype, tensor.shape, tensor.data.copy())
    return np.array(tensor, copy=True)
