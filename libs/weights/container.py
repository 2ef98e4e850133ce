"""The delta file: one manifest and its chunks in a single file.

Layout (all integers little-endian):

    b"RLPWD\\x00\\x02\\n"                 8-byte magic, format 2 (1 used sha256 checksums)
    u64 manifest length, 16-byte checksum (XXH3-128) of the manifest, manifest (msgpack)
    for each chunk listed in the manifest, in order: u64 length, chunk (msgpack)

Nothing may follow the last chunk. Truncation, trailing bytes, a bad magic or an altered
manifest raise CorruptDeltaError; chunk contents are checked when they are applied.

A chunk's record is the message the bus stores for it, byte for byte (format.encode_chunk).
`map_delta_file` therefore reads a file without copying a chunk: memory-mapped, each chunk
checked against the manifest by its record's size and header, and kept as its record
(`EncodedChunks.bodies`, what `transport.store_chunks` publishes), decoded only where a
chunk object is asked for. Writing, each payload goes to the file as it is, after its
record's prefix (format.chunk_prefix): byte-3b's lr 1e-5 delta is 560 MB, and every copy
of it costs a tenth of a second or more.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar, overload

import msgspec

from libs.durable_files import publish_durably
from libs.weights.errors import CorruptDeltaError
from libs.weights.format import Chunk, ChunkHeader, Manifest, chunk_prefix, encode_manifest
from libs.weights.hashing import DIGEST_BYTES, digest

MAGIC = b"RLPWD\x00\x02\n"
_U64 = struct.Struct("<Q")
_Record = TypeVar("_Record", Manifest, Chunk, "_ChunkRecord")


class _ChunkRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A chunk record with its payload left undecoded (a view of the record: no copy)."""

    header: ChunkHeader
    payload: msgspec.Raw


class EncodedChunks(Sequence[Chunk]):
    """A delta's chunks as their encoded records (`bodies`, the bus messages), each decoded
    to a Chunk only when it is asked for."""

    def __init__(self, bodies: list[memoryview]) -> None:
        self.bodies = bodies

    def __len__(self) -> int:
        return len(self.bodies)

    @overload
    def __getitem__(self, index: int) -> Chunk: ...

    @overload
    def __getitem__(self, index: slice) -> list[Chunk]: ...

    def __getitem__(self, index: int | slice) -> Chunk | list[Chunk]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _decode(self.bodies[index], Chunk, f"chunk {index}")


def pack_delta(manifest: Manifest, chunks: Sequence[Chunk]) -> bytes:
    """The delta file bytes for a manifest and its chunks."""
    return b"".join(_records(manifest, chunks))


def _records(manifest: Manifest, chunks: Sequence[Chunk]) -> Iterator[bytes]:
    """The delta file's parts in order, one chunk encoded at a time."""
    body = encode_manifest(manifest)
    yield from (MAGIC, _U64.pack(len(body)), digest(body), body)
    for chunk in chunks:
        prefix = chunk_prefix(chunk)
        yield _U64.pack(len(prefix) + len(chunk.payload))
        yield prefix
        yield chunk.payload


def unpack_delta(data: bytes | memoryview) -> tuple[Manifest, list[Chunk]]:
    """Manifest and chunks from delta file bytes, or CorruptDeltaError saying what is wrong."""
    manifest, records = _unpack_records(memoryview(data))
    chunks = [
        _decode(raw, Chunk, f"chunk {ref.index}")
        for raw, ref in zip(records, manifest.chunks, strict=True)
    ]
    return manifest, chunks


def _unpack_records(view: memoryview) -> tuple[Manifest, list[memoryview]]:
    """The manifest and each chunk's record, located and length-checked."""
    magic = bytes(view[: len(MAGIC)])
    if magic != MAGIC and magic[:6] == MAGIC[:6] and magic[7:] == MAGIC[7:]:
        raise CorruptDeltaError(
            f"delta file format {magic[6]}; this build reads format {MAGIC[6]}: re-encode it"
        )
    if magic != MAGIC:
        raise CorruptDeltaError("not an rlpipe delta file (bad magic)")
    at = len(MAGIC)
    body, at = _take(view, at, "manifest", checked=True)
    manifest = _decode(body, Manifest, "manifest")
    records = []
    for ref in manifest.chunks:
        raw, at = _take(view, at, f"chunk {ref.index}")
        records.append(raw)
    if at != len(view):
        raise CorruptDeltaError(f"{len(view) - at} unexpected bytes after the last chunk")
    return manifest, records


def _take(view: memoryview, at: int, what: str, checked: bool = False) -> tuple[memoryview, int]:
    """The length-prefixed record at `at` (checking the digest if present) and the next offset."""
    if at + _U64.size > len(view):
        raise CorruptDeltaError(f"file is truncated before the {what}")
    (length,) = _U64.unpack_from(view, at)
    at += _U64.size
    expected = bytes(view[at : at + DIGEST_BYTES]) if checked else None
    at += DIGEST_BYTES if checked else 0
    if at + length > len(view):
        raise CorruptDeltaError(f"file is truncated inside the {what}")
    record = view[at : at + length]
    if expected is not None and digest(record) != expected:
        raise CorruptDeltaError(f"the {what} does not match its hash")
    return record, at + length


def _decode(raw: memoryview, kind: type[_Record], what: str) -> _Record:
    try:
        return msgspec.msgpack.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise CorruptDeltaError(f"the {what} does not decode: {exc}") from exc


def write_delta_file(path: str | Path, manifest: Manifest, chunks: Sequence[Chunk]) -> None:
    """Write a delta file (to a temporary name first, so a crash leaves no partial file, and
    on disk before its name: libs.durable_files)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as file:  # record by record: no copy of the whole file in memory
        for part in _records(manifest, chunks):
            file.write(part)
    publish_durably(partial, target)


def read_delta_file(path: str | Path) -> tuple[Manifest, list[Chunk]]:
    """Read and parse a delta file."""
    return unpack_delta(Path(path).read_bytes())


def map_delta_file(path: str | Path) -> tuple[Manifest, EncodedChunks]:
    """A delta file's manifest and its chunks as records of the file memory-mapped (read only;
    the mapping lives as long as a record of it), each checked against the manifest: its
    size, and its header's index, version, base, target and payload hash."""
    with Path(path).open("rb") as file:
        size = file.seek(0, 2)
        if size < len(MAGIC):
            raise CorruptDeltaError("not an rlpipe delta file (bad magic)")
        mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)
    manifest, records = _unpack_records(memoryview(mapped))
    for raw, ref in zip(records, manifest.chunks, strict=True):
        header = _decode(raw, _ChunkRecord, f"chunk {ref.index}").header
        if (len(raw), header.index, header.payload_hash) != (
            ref.num_bytes,
            ref.index,
            ref.payload_hash,
        ) or (header.version, header.base_version, header.target_hash) != (
            manifest.version,
            manifest.base_version,
            manifest.target_hash,
        ):
            raise CorruptDeltaError(f"chunk {ref.index} is not the one its manifest lists")
    return manifest, EncodedChunks(records)
