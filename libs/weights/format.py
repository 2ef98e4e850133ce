"""Manifest and chunk types of the weight-delta format (msgpack via msgspec, no torch types).

A delta (or snapshot) of version `version` against `base_version` is one Manifest plus
chunks. The manifest lists every tensor of the target version with how it travels
(`same`: identical to the base, costs this entry only; `delta`: patched from the base;
`whole`: sent in full because it is new, reshaped, retyped, or this is a snapshot), the
names removed, and a reference to each chunk. A chunk carries one or more pieces (an
element range of one tensor each) and is decodable on its own. Hashes are sha256 truncated to
16 bytes, as lowercase hex (hashing.py).

The lead mirrors `Manifest` into proto/; keep these plain Structs.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FORMAT_VERSION = 1
HASH_NAME = "sha256-128"

Change = Literal["same", "delta", "whole"]
# sparse_add: gap-coded positions + zigzag (new - old mod 2^bits) values;
# sparse_xor: gap-coded positions + byte planes of (new ^ old);
# dense_xor: byte planes of (new ^ old) over the whole range; raw: byte planes of new.
Encoding = Literal["sparse_add", "sparse_xor", "dense_xor", "raw"]


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of the target version and how it travels."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: list[int]
    change: Change
    digest: str  # hash of the tensor's bytes (see hashing.tensor_digest)
    num_changed: int  # elements that differ from the base (numel for `whole`)


class ChunkRef(msgspec.Struct, frozen=True, kw_only=True):
    """What the manifest knows about a chunk before fetching it."""

    index: int
    num_bytes: int  # size of the msgpack-encoded Chunk
    payload_hash: str
    tensors: list[str]  # names the chunk writes, in order


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A versioned delta or snapshot: the target's tensors, removed names and chunk list."""

    format_version: int
    version: int
    base_version: int | None  # None for a snapshot
    base_hash: str | None  # version hash of the base; None for a snapshot
    target_hash: str  # version hash of the target (see hashing.version_hash)
    tensors: list[TensorEntry]
    removed: list[str]
    chunks: list[ChunkRef]
    hash_name: str = HASH_NAME

    @property
    def is_snapshot(self) -> bool:
        """True when the manifest needs no base."""
        return self.base_version is None


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


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as msgpack bytes."""
    return msgspec.msgpack.encode(manifest)
