"""Manifest and chunk types of the weight-delta format (msgpack via msgspec, no torch types).

A delta (or snapshot) of version `version` against `base_version` is one Manifest plus
chunks. The manifest lists every tensor of the target version with how it travels
(`same`: identical to the base, costs this entry only; `delta`: patched from the base;
`whole`: sent in full because it is new, reshaped, retyped, or this is a snapshot), the
names removed, and a reference to each chunk. A chunk carries one or more pieces (an
element range of one tensor each) and is decodable on its own. Hashes are XXH3-128, as
lowercase hex (hashing.py); a manifest of another format version or hash is refused
(`check_format`).

The manifest structs are defined once, in proto/ (the weight announcement carries the
manifest); they are re-exported here under the codec's names.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from libs.weights.errors import CorruptDeltaError
from proto.messages import WEIGHT_FORMAT_VERSION as FORMAT_VERSION
from proto.messages import WEIGHT_HASH_NAME as HASH_NAME
from proto.messages import ChunkRef, TensorEntry
from proto.messages import TensorChange as Change
from proto.messages import WeightManifest as Manifest

__all__ = [
    "FORMAT_VERSION",
    "HASH_NAME",
    "Change",
    "Chunk",
    "ChunkHeader",
    "ChunkRef",
    "Encoding",
    "Manifest",
    "PieceHeader",
    "TensorEntry",
    "VersionInfo",
    "check_format",
    "chunk_prefix",
    "encode_chunk",
    "encode_manifest",
]

# sparse_add: gap-coded positions + zigzag (new - old mod 2^bits) values;
# sparse_xor: gap-coded positions + byte planes of (new ^ old);
# dense_xor: byte planes of (new ^ old) over the whole range; raw: byte planes of new.
Encoding = Literal["sparse_add", "sparse_xor", "dense_add", "dense_xor", "raw"]


class PieceHeader(msgspec.Struct, frozen=True, kw_only=True):
    """An element range [start, stop) of one tensor inside a chunk, and its streams."""

    name: str
    start: int
    stop: int
    encoding: Encoding
    num_changed: int
    stream_sizes: list[int]  # compressed bytes of each stream in the payload, in order
    raw_sizes: list[int]  # decompressed bytes of each stream


class ChunkHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Identity and checksums of a chunk."""

    format_version: int
    version: int
    base_version: int | None
    target_hash: str  # ties the chunk to exactly one manifest
    index: int
    pieces: list[PieceHeader]
    payload_hash: str  # hash of `Chunk.payload`
    output_hash: str  # hash of the bytes the chunk writes (see codec module docstring)


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """A self-contained unit of a delta: header plus the concatenated compressed streams."""

    header: ChunkHeader
    payload: bytes


class VersionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver holds: a version number (if known) and the version hash."""

    version: int | None
    hash: str


def encode_chunk(chunk: Chunk) -> bytes:
    """The chunk as msgpack bytes (what travels on the bus)."""
    return msgspec.msgpack.encode(chunk)


def chunk_prefix(chunk: Chunk) -> bytes:
    """The msgpack bytes of `chunk` before its payload: `chunk_prefix(c) + c.payload ==
    encode_chunk(c)`, so a writer can send the payload without copying it into one buffer.
    The payload is the last field, a msgpack bin (8, 16 or 32: a 2, 3 or 5 byte header)."""
    bare = encode_chunk(Chunk(header=chunk.header, payload=b""))
    assert bare.endswith(b"\xc4\x00"), "the payload is no longer the chunk's last field"
    size = len(chunk.payload)
    if size < 1 << 8:
        head = b"\xc4" + size.to_bytes(1, "big")
    elif size < 1 << 16:
        head = b"\xc5" + size.to_bytes(2, "big")
    else:
        head = b"\xc6" + size.to_bytes(4, "big")
    return bare[:-2] + head


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as msgpack bytes."""
    return msgspec.msgpack.encode(manifest)


def check_format(manifest: Manifest) -> None:
    """Raise CorruptDeltaError unless this build reads the manifest's format and hash."""
    if manifest.format_version != FORMAT_VERSION or manifest.hash_name != HASH_NAME:
        raise CorruptDeltaError(
            f"delta has format {manifest.format_version} ({manifest.hash_name}); this build "
            f"reads format {FORMAT_VERSION} ({HASH_NAME}): re-encode it, or decode with the "
            "build that wrote it"
        )
