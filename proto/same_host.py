"""The same-host weight handoff: a trainer shares its published weights with the rollout
workers of its own host, in memory, and tells them which version sits where.

The trainer keeps a shelf of a few slots, each one copy of the weights (as workers run them)
in memory a worker on the same host can map: CUDA IPC memory on a GPU, a POSIX shared memory
block on a CPU. The shelf is described once (`SameHostShelf`, KV key
`same_host_shelf_key(host_id)`), and each version written into a slot is announced on
`same_host_subject(host_id)` (core NATS: a lost notice is replaced by the next one, and the
newest is also kept under `same_host_version_key(host_id)`). Workers elsewhere never see these
subjects; they take the same versions from the delta chain (weights announcements).

A slot begins with an 8-byte little-endian signed version: -1 while the trainer writes it,
then the version written. A worker reads it before and after copying and keeps the copy only
when both equal the notice's version (libs/weights/same_host.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from proto.messages import Message

SAME_HOST_PREFIX = "rl.weights.same_host"
# Bytes before the first tensor of a slot: the version word, padded to keep tensors aligned.
SLOT_HEADER_BYTES = 256

SharedMemoryKind = Literal["cuda_ipc", "posix_shm"]


def same_host_subject(host_id: str) -> str:
    """Core NATS subject of the version notices of `host_id`'s trainer."""
    return f"{SAME_HOST_PREFIX}.{host_id}"


def same_host_shelf_key(host_id: str) -> str:
    """KV key (state bucket) of the shelf `host_id`'s trainer shares."""
    return f"same_host_shelf.{host_id}"


def same_host_version_key(host_id: str) -> str:
    """KV key (state bucket) of the newest version notice of `host_id`'s trainer."""
    return f"same_host_version.{host_id}"


class SharedSlot(msgspec.Struct, frozen=True, kw_only=True):
    """Where one copy of the weights lives. CUDA IPC: the allocation's handle and the slot's
    place in it (the fields torch's `_share_cuda_` gives); POSIX: the shared memory name."""

    size_bytes: int
    shm_name: str | None = None
    cuda_handle: bytes | None = None
    cuda_offset_bytes: int = 0
    cuda_ref_counter_handle: bytes | None = None
    cuda_ref_counter_offset: int = 0
    cuda_event_handle: bytes | None = None
    cuda_event_sync_required: bool = False


class SharedTensor(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor's place in every slot."""

    name: str
    dtype: str  # torch dtype name without the prefix, e.g. "bfloat16"
    shape: list[int]
    offset_bytes: int  # from the start of the slot (after the header)


class SameHostShelf(Message, kw_only=True):
    """The slots a trainer shares with the workers of its host, and the tensors' layout."""

    SCHEMA: ClassVar[str] = "same_host_shelf"

    shelf_id: str  # new for every trainer process: a notice names the shelf it refers to
    host_id: str
    kind: SharedMemoryKind
    # The card holding the slots (CUDA: its UUID, so a worker with other visible devices
    # finds it); empty on a CPU.
    device_uuid: str = ""
    slots: list[SharedSlot]
    tensors: list[SharedTensor]
    created_at: float = 0.0


class SameHostVersion(Message, kw_only=True):
    """Version `version` is complete in slot `slot` of shelf `shelf_id`."""

    SCHEMA: ClassVar[str] = "same_host_version"

    shelf_id: str
    version: int
    slot: int
    # Sum of the slot's tensors read as little-endian int64 words (wrapping; a tensor's last
    # bytes short of a word as unsigned bytes), for a worker to check its copy end to end.
    checksum: int
    step: int | None = None
    published_at: float = 0.0  # Unix time the trainer offered the version (its step's end)
    # Signed by the trainer as weight announcements are (libs/weights/signing.py).
    signature: bytes = b""
    key_id: str = ""
    policy_digest: str = ""
