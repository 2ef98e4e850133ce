"""Encode a new model version as a delta against a base version, or as a snapshot.

`encode(base, new, ...)` compares exact bytes tensor by tensor: identical tensors cost a
manifest entry, tensors whose dtype and shape are unchanged travel as deltas, the rest
(added, reshaped, retyped) travel whole. The ranges are planned into chunks (chunking.py),
each chunk's pieces are encoded with the smallest measured encoding (encodings.py), and
chunks are encoded on `threads` threads. `encode_snapshot(new, ...)` sends every tensor whole.

A chunk's output hash is the XXH3-128 over, for each piece in order, its name, start and
count, the int64 LE positions it writes (sparse encodings only) and the bytes it writes;
the manifest's target hash covers every byte of the target version (hashing.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from libs.weights.chunking import (
    PiecePlan,
    TensorJob,
    dense_bytes_per_width,
    parallel_target,
    plan_chunks,
    split_plan,
)
from libs.weights.encodings import (
    DenseCodes,
    encode_delta,
    encode_dense_add,
    encode_whole,
    hash_written,
    written_by,
)
from libs.weights.format import (
    FORMAT_VERSION,
    Change,
    Chunk,
    ChunkHeader,
    ChunkRef,
    Manifest,
    PieceHeader,
    TensorEntry,
    encode_chunk,
)
from libs.weights.hashing import (
    DIGEST_BYTES,
    digest,
    new_hasher,
    state_hash,
    tensor_digests,
    version_hash,
)
from libs.weights.scan import Changes, changed_elements
from libs.weights.tensors import RawTensor, State, check_dtype, raw_state

# Capped at the server's max payload (chunk_bytes_for; 1 MB on a plain nats-server, 8 MB in
# deploy/nats). A chunk is a message to store and fetch, and the fetch is bound per message:
# byte-3b's lr 1e-5 version (560 MB) fetched in 0.98 s as 4 MiB chunks, 1.39 s as 1 MiB.
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
HEADROOM_BYTES = 64 << 10  # room for the chunk header and estimate error below the maximum
# A tensor whose sampled elements changed at least this often is sent as a dense delta
# (every element, no positions) without scanning it for changes. Above 1/8 the sparse path
# also tries the dense forms and compresses every candidate: on 32M bf16 values with 15%
# (30%) changed, one core, that took 0.92 s (1.88 s) for a 16.7x (9.5x) ratio where
# dense_add took 0.20 s (0.27 s) for 10.1x (7.4x). The few-step deltas of fp32-master
# training fall in that range, where time is what counts. Below 1/8 sparse wins on size
# (a 10% bf16 step: under 10 bits per change) and stays.
DENSE_FRACTION = 1 / 8
DENSITY_SAMPLE = 1 << 16  # elements compared to estimate a tensor's changed fraction


# The base of each tensor the chunks patch, or a dense delta's codes packed on a device.
Sources = Mapping[str, RawTensor | DenseCodes]

# Finds the changed elements of one tensor: (name, old, new) -> Changes.
Scan = Callable[[str, RawTensor, RawTensor], Changes]


def chunk_bytes_for(max_payload: int, wanted: int = DEFAULT_MAX_CHUNK_BYTES) -> int:
    """The largest chunk to encode for a bus whose messages are at most `max_payload`
    bytes: a chunk and its headers must fit one message."""
    return min(wanted, max_payload - HEADROOM_BYTES // 16)


class EncodeOptions(BaseModel):
    """How to chunk and compress (the weight-broadcaster's `encode`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_chunk_bytes: int = Field(
        DEFAULT_MAX_CHUNK_BYTES,
        ge=16 << 10,
        le=8 << 20,
        description="Largest stored chunk in bytes, msgpack-encoded (capped at the server's "
        "max payload)",
    )
    target_chunk_bytes: int | None = Field(
        None, ge=1, description="Estimated fill of a chunk; unset: max_chunk_bytes less 64 KiB"
    )
    # zstd level 1: faster and smaller than 3 on weight streams (Huffman pays, match finding not).
    level: int = Field(1, ge=1, le=19, description="zstd level of chunk payloads")
    # zstd and numpy release the GIL: a second thread speeds a version's scan and encode.
    threads: int = Field(2, ge=1, description="Threads for scanning, hashing and chunk encoding")

    def target(self) -> int:
        """The chunk fill target in bytes."""
        if self.max_chunk_bytes < 16 << 10:
            raise ValueError(f"max_chunk_bytes={self.max_chunk_bytes} is too small; use >= 16384")
        default = self.max_chunk_bytes - min(HEADROOM_BYTES, self.max_chunk_bytes // 4)
        return min(self.target_chunk_bytes or default, default)


@dataclass
class EncodeTimes:
    """Where an encode's time went, filled in by `encode` and `encode_device` when given one:
    the rest of the call (hashing the target, coding and assembling the chunks) is the
    encode proper."""

    diff_s: float = 0.0  # finding the changed elements (on a GPU: and their copy to the host)


@dataclass(frozen=True)
class _Body:
    """An encoded chunk before it gets its index."""

    pieces: list[PieceHeader]
    payload: bytes
    output_hash: str


def encode(
    base: State,
    new: State,
    *,
    base_version: int,
    version: int,
    options: EncodeOptions | None = None,
    base_hash: str | None = None,
    scan: Scan | None = None,
    times: EncodeTimes | None = None,
) -> tuple[Manifest, list[Chunk]]:
    """Delta of `new` against `base` as a manifest and chunks.

    `base_hash` is the base's version hash if the caller knows it (the target_hash of the
    manifest that produced it); otherwise it is computed, which reads every base byte.
    `scan(name, old, new)` finds the changed elements of a tensor that is not dense (the
    weight-broadcaster's on a GPU); default: the host scan `changed_elements`.
    """
    opts = options or EncodeOptions()
    old_raw, new_raw = raw_state(base), raw_state(new)
    if base_hash is None:
        base_hash = state_hash(old_raw, opts.threads)
    started = time.perf_counter()
    jobs, changes = _classify(old_raw, new_raw, opts.threads, scan)
    if times is not None:
        times.diff_s = time.perf_counter() - started
    removed = [name for name in old_raw if name not in new_raw]
    return _finish(old_raw, new_raw, jobs, changes, removed, base_version, base_hash, version, opts)


def encode_snapshot(
    new: State, *, version: int, options: EncodeOptions | None = None
) -> tuple[Manifest, list[Chunk]]:
    """Every tensor of `new` whole, chunked and compressed; needs no base to decode."""
    opts = options or EncodeOptions()
    new_raw = raw_state(new)
    for tensor in new_raw.values():
        check_dtype(tensor.dtype)
    jobs = [TensorJob(n, t.width, t.numel, None) for n, t in new_raw.items()]
    changes: dict[str, Change] = {n: "whole" for n in new_raw}
    return _finish({}, new_raw, jobs, changes, [], None, None, version, opts)


def _classify(
    old: dict[str, RawTensor], new: dict[str, RawTensor], threads: int, scan: Scan | None = None
) -> tuple[list[TensorJob], dict[str, Change]]:
    """Which tensors are the same, deltas (with changed positions) or whole."""
    jobs: list[TensorJob] = []
    changes: dict[str, Change] = {}
    for name, tensor in new.items():
        check_dtype(tensor.dtype)
        before = old.get(name)
        if before is None or before.dtype != tensor.dtype or before.shape != tensor.shape:
            jobs.append(TensorJob(name, tensor.width, tensor.numel, None))
            changes[name] = "whole"
            continue
        density = sampled_density(before, tensor)
        if density >= DENSE_FRACTION:
            # No scan: nearly every element is sent anyway (encode_dense_add).
            cost = dense_bytes_per_width(density)
            jobs.append(TensorJob(name, tensor.width, tensor.numel, None, True, cost))
            changes[name] = "delta"
            continue
        if scan is None:
            found = changed_elements(before.data, tensor.data, tensor.width, threads)
        else:
            found = scan(name, before, tensor)
        changes[name] = "delta" if found.positions.size else "same"
        if found.positions.size:
            jobs.append(TensorJob(name, tensor.width, tensor.numel, found))
    return jobs, changes


def sampled_density(old: RawTensor, new: RawTensor) -> float:
    """Fraction of changed elements among up to DENSITY_SAMPLE evenly spaced ones."""
    old_units, new_units = old.units(), new.units()
    step = max(1, old_units.size // DENSITY_SAMPLE)
    sample_old, sample_new = old_units[::step], new_units[::step]
    if not sample_old.size:
        return 0.0
    return float(np.count_nonzero(sample_old != sample_new)) / sample_old.size


def _finish(
    old: Sources,
    new: dict[str, RawTensor],
    jobs: list[TensorJob],
    changes: dict[str, Change],
    removed: list[str],
    base_version: int | None,
    base_hash: str | None,
    version: int,
    opts: EncodeOptions,
) -> tuple[Manifest, list[Chunk]]:
    """Hash the target, encode the chunks and assemble the manifest."""
    digests = tensor_digests(new.values(), opts.threads)
    plans = plan_chunks(jobs, parallel_target(jobs, opts.target()))
    bodies = _encode_bodies(
        old, new, plans, opts.model_copy(update={"threads": encode_threads(jobs, opts.threads)})
    )
    counts: dict[str, int] = {}
    for body in bodies:
        for piece in body.pieces:
            counts[piece.name] = counts.get(piece.name, 0) + piece.num_changed
    entries = [
        TensorEntry(
            name=n,
            dtype=t.dtype,
            shape=list(t.shape),
            change=changes[n],
            digest=d,
            num_changed=counts.get(n, 0),
        )
        for (n, t), d in zip(new.items(), digests, strict=True)
    ]
    target_hash = version_hash((e.name, e.dtype, e.shape, e.digest) for e in entries)
    chunks = [_assemble(i, b, version, base_version, target_hash) for i, b in enumerate(bodies)]
    refs = [_chunk_ref(chunk) for chunk in chunks]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        version=version,
        base_version=base_version,
        base_hash=base_hash,
        target_hash=target_hash,
        tensors=entries,
        removed=removed,
        chunks=refs,
    )
    return manifest, chunks


# Threads that encode a version whose work is mostly sparse pieces: their numpy calls are
# short, and the GIL between them is held by one thread at a time. On an H200 host (16
# cores) byte-0.5b's lr 1e-6 version (11M changes) encoded in 0.14-0.16 s on 8 threads and
# 0.22 s on 16, while byte-3b's lr 1e-5 (dense pieces, zstd: releases the GIL) took 0.44 s on
# 16 and 0.69-0.74 on 8. A change costs a sparse piece ~26 ns of one core, an element of a
# dense piece ~0.85 (encodings.py).
SPARSE_THREADS = 8
SPARSE_TO_DENSE_COST = 30


def encode_threads(jobs: list[TensorJob], threads: int) -> int:
    """`threads`, or SPARSE_THREADS at most when sparse pieces are most of the work."""
    sparse = sum(job.changes.positions.size for job in jobs if job.changes is not None)
    dense = sum(job.numel for job in jobs if job.changes is None or job.dense)
    return threads if dense >= SPARSE_TO_DENSE_COST * sparse else min(threads, SPARSE_THREADS)


def _encode_bodies(
    old: Sources,
    new: dict[str, RawTensor],
    plans: list[list[PiecePlan]],
    opts: EncodeOptions,
) -> list[_Body]:
    """Encode every planned chunk (in parallel), splitting any that exceeds the maximum."""

    def run(plan: list[PiecePlan]) -> list[_Body]:
        return _encode_fitting(old, new, plan, opts)

    if opts.threads > 1 and len(plans) > 1:
        with ThreadPoolExecutor(opts.threads) as pool:
            nested = list(pool.map(run, plans))
    else:
        nested = [run(plan) for plan in plans]
    return [body for group in nested for body in group]


def _encode_fitting(
    old: Sources, new: dict[str, RawTensor], plan: list[PiecePlan], opts: EncodeOptions
) -> list[_Body]:
    body = _encode_body(old, new, plan, opts.level)
    # Size with the largest index/version fields the chunk can get: an upper bound.
    largest = _assemble(1 << 62, body, 1 << 62, 1 << 62, "0" * 2 * DIGEST_BYTES)
    if encoded_size(largest) <= opts.max_chunk_bytes:
        return [body]
    first, second = split_plan(plan)
    return _encode_fitting(old, new, first, opts) + _encode_fitting(old, new, second, opts)


def _encode_body(
    old: Sources, new: dict[str, RawTensor], plan: list[PiecePlan], level: int
) -> _Body:
    """Encode the pieces of one chunk and hash what they write."""
    headers, streams = [], []
    hasher = new_hasher()
    for piece in plan:
        name, start, stop = piece.job.name, piece.start, piece.stop
        new_units = new[name].units()[start:stop]
        if piece.job.dense:
            source = old[name]
            if isinstance(source, DenseCodes):  # packed on the device
                encoded = source.encode(start, stop, level)
            else:
                encoded = encode_dense_add(source.units()[start:stop], new_units, level)
            written = written_by(new_units, encoded, new_units[:0], new_units[:0])
        elif piece.job.changes is None:
            encoded = encode_whole(new_units, level)
            written = written_by(new_units, encoded, new_units[:0], new_units[:0])
        else:
            positions, old_vals, new_vals = _relative(piece.job.changes, start, stop)
            base = old.get(name)  # None: rebuilt from the target if needed (GPU path)
            assert not isinstance(base, DenseCodes), f"{name} is not a dense delta"
            old_units = None if base is None else base.units()[start:stop]
            encoded = encode_delta(old_units, new_units, positions, old_vals, new_vals, level)
            written = written_by(new_units, encoded, positions, new_vals)
        hash_written(hasher, name, start, written)
        streams.extend(encoded.streams)
        headers.append(
            PieceHeader(
                name=name,
                start=start,
                stop=stop,
                encoding=encoded.encoding,
                num_changed=encoded.num_changed,
                stream_sizes=[len(s) for s in encoded.streams],
                raw_sizes=encoded.raw_sizes,
            )
        )
    return _Body(headers, b"".join(streams), hasher.digest().hex())


def _relative(changes: Changes, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (relative to start), old and new values of the changes in [start, stop)."""
    left, right = np.searchsorted(changes.positions, [start, stop])
    positions = changes.positions[left:right]
    if start:
        positions = positions - start  # a piece that starts at 0 needs no copy
    return positions, changes.old[left:right], changes.new[left:right]


def _assemble(
    index: int, body: _Body, version: int, base_version: int | None, target_hash: str
) -> Chunk:
    header = ChunkHeader(
        format_version=FORMAT_VERSION,
        version=version,
        base_version=base_version,
        target_hash=target_hash,
        index=index,
        pieces=body.pieces,
        payload_hash=digest(body.payload).hex(),
        output_hash=body.output_hash,
    )
    return Chunk(header=header, payload=body.payload)


def encoded_size(chunk: Chunk) -> int:
    """len(encode_chunk(chunk)) without encoding the payload: msgpack stores it as bin 8, 16
    or 32 (a 2, 3 or 5 byte header). A chunk of a 5.5 GB version's delta costs one copy of
    its payload less, made holding the GIL that the other encode threads wait for."""
    bare = len(encode_chunk(Chunk(header=chunk.header, payload=b"")))
    size = len(chunk.payload)
    return bare + size + (0 if size < 1 << 8 else 1 if size < 1 << 16 else 3)


def _chunk_ref(chunk: Chunk) -> ChunkRef:
    names: list[str] = []
    for piece in chunk.header.pieces:
        if not names or names[-1] != piece.name:
            names.append(piece.name)
    return ChunkRef(
        index=chunk.header.index,
        num_bytes=encoded_size(chunk),
        payload_hash=chunk.header.payload_hash,
        tensors=names,
    )
