"""Hashes that identify tensors and whole model versions.

tensor digest: sha256 over the concatenated sha256 digests of the tensor's bytes split into
128 KiB segments, truncated to 16 bytes (a two-level tree: one big tensor hashes on several
threads, and sha256 on cache-sized segments runs at about 1.6 GB/s per core here, against
1.0 for blake2b). version hash: the same 16-byte sha256 over the msgpack encoding of
`[[name, dtype, shape, tensor digest], ...]` sorted by name. Two states have the same
version hash exactly when they hold the same names, dtypes, shapes and bytes (up to hash
collisions).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from libs.weights.tensors import RawTensor

SEGMENT_BYTES = 128 << 10
DIGEST_BYTES = 16


def new_hasher() -> Any:
    """An incremental hasher whose digest()[:DIGEST_BYTES] is our checksum."""
    return hashlib.sha256()


def digest(data: bytes | memoryview | np.ndarray) -> bytes:
    """16-byte sha256 checksum of a buffer (hashlib releases the GIL on large buffers)."""
    buffer = data.data if isinstance(data, np.ndarray) else data
    return hashlib.sha256(buffer).digest()[:DIGEST_BYTES]


def _leaves(data: np.ndarray) -> bytes:
    """Concatenated full sha256 digests of the 128 KiB segments of a buffer."""
    if data.size == 0:
        return hashlib.sha256(b"").digest()
    step = SEGMENT_BYTES
    return b"".join(
        hashlib.sha256(data[i : i + step].data).digest() for i in range(0, data.size, step)
    )


def _groups(data: np.ndarray, count: int) -> list[np.ndarray]:
    """Split a buffer into `count` parts on segment boundaries (for parallel hashing)."""
    segments = max(1, -(-data.size // SEGMENT_BYTES))
    per = -(-segments // count) * SEGMENT_BYTES
    return [data[i : i + per] for i in range(0, max(data.size, 1), per)]


def tensor_digests(tensors: Iterable[RawTensor], threads: int = 1) -> list[str]:
    """Digest of each tensor (hex), hashing segments on `threads` threads."""
    jobs = [_groups(t.data, threads) for t in tensors]
    flat = [part for parts in jobs for part in parts]
    if threads > 1 and len(flat) > 1:
        with ThreadPoolExecutor(threads) as pool:
            leaves = list(pool.map(_leaves, flat))
    else:
        leaves = [_leaves(part) for part in flat]
    digests, at = [], 0
    for parts in jobs:
        digests.append(digest(b"".join(leaves[at : at + len(parts)])).hex())
        at += len(parts)
    return digests


def version_hash(entries: Iterable[tuple[str, str, list[int], str]]) -> str:
    """Version hash over (name, dtype, shape, tensor digest) entries, canonical by name."""
    rows = sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in entries)
    return digest(msgspec.msgpack.encode(rows)).hex()


def state_hash(state: Mapping[str, RawTensor], threads: int = 1) -> str:
    """Version hash of a whole state (hashes every byte: about 1.6 GB/s per thread)."""
    digests = tensor_digests(state.values(), threads)
    rows = [
        (n, t.dtype, list(t.shape), d) for (n, t), d in zip(state.items(), digests, strict=True)
    ]
    return version_hash(rows)
