"""The delta file: one manifest and its chunks in a single file.

Layout (all integers little-endian):

    b"RLPWD\\x00\\x02\\n"                 8-byte magic, format 2 (1 used sha256 checksums)
    u64 manifest length, 16-byte checksum (XXH3-128) of the manifest, manifest (msgpack)
    for each chunk listed in the manifest, in order: u64 length, chunk (msgpack)

Nothing may follow the last chunk. Truncation, trailing bytes, a bad magic or an altered
manifest raise CorruptDeltaError; chunk contents are checked when they are applied.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec

from libs.weights.errors import CorruptDeltaError
from libs.weights.format import Chunk, Manifest, encode_chunk, encode_manifest
from libs.weights.hashing import DIGEST_BYTES, digest

MAGIC = b"RLPWD\x00\x02\n"
_U64 = struct.Struct("<Q")
_Record = TypeVar("_Record", Manifest, Chunk)


def pack_delta(manifest: Manifest, chunks: Sequence[Chunk]) -> bytes:
    """The delta file bytes for a manifest and its chunks."""
    return b"".join(_records(manifest, chunks))


def _records(manifest: Manifest, chunks: Sequence[Chunk]) -> Iterator[bytes]:
    """The delta file's parts in order, one chunk encoded at a time."""
    body = encode_manifest(manifest)
    yield from (MAGIC, _U64.pack(len(body)), digest(body), body)
    for chunk in chunks:
        data = encode_chunk(chunk)
        yield _U64.pack(len(data))
        yield data


def unpack_delta(data: bytes | memoryview) -> tuple[Manifest, list[Chunk]]:
    """Manifest and chunks from delta file bytes, or CorruptDeltaError saying what is wrong."""
    view = memoryview(data)
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
    chunks = []
    for ref in manifest.chunks:
        raw, at = _take(view, at, f"chunk {ref.index}")
        chunks.append(_decode(raw, Chunk, f"chunk {ref.index}"))
    if at != len(view):
        raise CorruptDeltaError(f"{len(view) - at} unexpected bytes after the last chunk")
    return manifest, chunks


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
    """Write a delta file (to a temporary name first, so a crash leaves no partial file)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as file:  # record by record: no copy of the whole file in memory
        for part in _records(manifest, chunks):
            file.write(part)
    partial.replace(target)


def read_delta_file(path: str | Path) -> tuple[Manifest, list[Chunk]]:
    """Read and parse a delta file."""
    return unpack_delta(Path(path).read_bytes())
