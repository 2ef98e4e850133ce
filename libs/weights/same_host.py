"""Weights handed from the trainer to the workers of its own host in memory: card to card.

The delta chain (libs/weights: compressed, hashed, bit-exact, on the bus) is what every
worker can follow, anywhere. A worker on the trainer's host needs none of it: the trainer
already makes a copy of its weights as workers run them after each step
(`Learner.published_state`), and a GPU copies a 0.5B bf16 state in about a millisecond.
So the trainer also writes that copy into a slot of a shelf its host's workers map (CUDA IPC
memory on a GPU, POSIX shared memory on a CPU) and says which version sits in which slot;
the worker copies the slot into its engine's live weights in the swap pause. No codec, no
host copy, no fetch.

    shelf = ShelfWriter.create(state, host_id, num_slots=2)      # the trainer's side
    notice = shelf.write(state, version=7)                       # blocks until it is complete
    shelf.description                                            # SameHostShelf, for the KV
    reader = ShelfReader.open(shelf.description)                 # a worker's side
    reader.copy_into(engine_live_tensors, notice, verify=True)   # raises TornCopyError, ...

Torn copies: the trainer writes versions into the slots in turn and never waits for
workers, so a slot may be rewritten while a worker copies it (only if the trainer makes
`num_slots` versions during one copy of milliseconds). The slot's header says which version
it holds (-1 while written): the reader checks it before and after its copy and raises
TornCopyError when it changed; the worker then takes the next notice, whose slot is whole.
`verify` also sums the copied tensors and compares with the notice's checksum, so what the
engine runs is the trainer's version bit for bit.

Same host means the same machine and, for CUDA, the card visible to both processes (found by
its UUID: the worker may number its cards differently). A worker that cannot map the shelf
raises SameHostUnavailable and follows the delta chain instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from libs.weights.errors import WeightsError
from proto.same_host import (
    SLOT_HEADER_BYTES,
    SameHostShelf,
    SameHostVersion,
    SharedSlot,
    SharedTensor,
)

# Tensors start at multiples of this in a slot: any dtype's view is aligned, and the int64
# view of the checksum too.
ALIGN_BYTES = 256
WRITING = -1  # the header while a version is written
SHM_DIR = "/dev/shm"


class SameHostShareConfig(BaseModel):
    """How a trainer shares its versions with the workers of its host (`trainer.same_host`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        True, description="Share each published version in memory with this host's workers"
    )
    slots: int = Field(
        2, ge=2, le=8,
        description="Copies of the weights kept (each the size of the published weights): "
        "a worker copying a slot the trainer rewrites retries on the next version",
    )  # fmt: skip
    host_id: str = Field(
        "", description="Name of this host for the handoff; empty: derived from the machine"
    )
    signing_key: Path | None = Field(
        None,
        description="Private key signing each shared version (the weight-broadcaster's "
        "signing_key); unset: shared unsigned, taken only by workers that allow unsigned",
    )


class SameHostTakeConfig(BaseModel):
    """How a rollout-worker takes versions from its host's trainer (`rollout-worker.same_host`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        True, description="Take versions from the trainer's memory when it runs on this host"
    )
    host_id: str = Field(
        "", description="Name of this host for the handoff; empty: derived from the machine"
    )
    verify: bool = Field(
        True, description="Check each copied version's checksum against the trainer's"
    )
    fallback_after_s: float = Field(
        10.0, gt=0,
        description="Follow the delta chain again when no version came this way for this long "
        "while a newer one is announced there",
    )  # fmt: skip


class SameHostUnavailable(WeightsError):
    """This process cannot map the shelf (another host, the card not visible, no access)."""


class TornCopyError(WeightsError):
    """The slot was rewritten (or is not the notice's version) while it was copied."""


class ChecksumMismatchError(WeightsError):
    """The copied weights do not sum to the trainer's checksum."""


def machine_host_id() -> str:
    """This machine's name for the handoff: the hostname and the kernel's boot id (a
    container of another machine with the same name differs), as a NATS subject token."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as file:
        boot = file.read().strip()
    digest = hashlib.blake2s(f"{socket.gethostname()}/{boot}".encode(), digest_size=4).hexdigest()
    name = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40]
    return f"{name}-{digest}"


def resolve_host_id(configured: str) -> str:
    """`configured` when set (checked to be one subject token), else `machine_host_id()`."""
    if not configured:
        return machine_host_id()
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", configured):
        raise ValueError(f"same_host.host_id {configured!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return configured


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the tensors' bytes as little-endian int64 words, wrapping (a tensor's bytes
    short of a word as unsigned bytes); computed on the tensors' device, one sync."""
    parts = []
    for tensor in tensors:
        data = tensor.detach().reshape(-1).view(torch.uint8)
        whole = data.numel() // 8 * 8
        if whole:
            words = data[:whole]
            if words.storage_offset() % 8:
                words = words.clone()
            parts.append(words.view(torch.int64).sum())
        if whole < data.numel():
            parts.append(data[whole:].to(torch.int64).sum())
    if not parts:
        return 0
    total = torch.stack(parts).sum().item()
    return int(total)


@dataclass(frozen=True)
class _Layout:
    tensors: list[SharedTensor]
    size_bytes: int  # of one slot, header included


def _layout(state: Mapping[str, torch.Tensor]) -> _Layout:
    entries, offset = [], 0
    for name, tensor in state.items():
        entries.append(
            SharedTensor(
                name=name,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=list(tensor.shape),
                offset_bytes=offset,
            )
        )
        nbytes = tensor.numel() * tensor.element_size()
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return _Layout(entries, SLOT_HEADER_BYTES + offset)


def _views(flat: torch.Tensor, tensors: list[SharedTensor]) -> dict[str, torch.Tensor]:
    """Typed views of one slot's tensors (after its header)."""
    views = {}
    for entry in tensors:
        dtype = getattr(torch, entry.dtype)
        numel = 1
        for size in entry.shape:
            numel *= size
        start = SLOT_HEADER_BYTES + entry.offset_bytes
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        views[entry.name] = flat[start : start + nbytes].view(dtype).view(entry.shape)
    return views


def _header(flat: torch.Tensor) -> torch.Tensor:
    return flat[:8].view(torch.int64)


class ShelfWriter:
    """The trainer's shelf: `num_slots` copies of the weights its host's workers can map."""

    def __init__(
        self,
        description: SameHostShelf,
        flats: list[torch.Tensor],
        memories: list[shared_memory.SharedMemory],
    ) -> None:
        self.description = description
        self._flats = flats
        self._memories = memories  # POSIX blocks (CPU): unlinked on close
        self._views = [_views(flat, description.tensors) for flat in flats]
        self._next_slot = 0
        # On a card, slots are written on a stream of their own, so a copy overlaps the
        # trainer's next step instead of waiting for it (write's `ready` orders it after the
        # state was made); None on a CPU.
        device = flats[0].device if flats else None
        self._stream = torch.cuda.Stream(device) if device and device.type == "cuda" else None

    @classmethod
    def create(
        cls, state: Mapping[str, torch.Tensor], host_id: str, num_slots: int = 2
    ) -> ShelfWriter:
        """Slots for states shaped as `state`, on its device (all its tensors on one)."""
        devices = {tensor.device for tensor in state.values()}
        if len(devices) != 1:
            raise ValueError(f"the shared state spans devices {sorted(map(str, devices))}")
        device = devices.pop()
        layout = _layout(state)
        shelf_id = uuid.uuid4().hex
        flats, memories, slots = [], [], []
        for index in range(num_slots):
            if device.type == "cuda":
                flat = torch.empty(layout.size_bytes, dtype=torch.uint8, device=device)
                slots.append(_cuda_slot(flat))
            elif device.type == "cpu":
                _check_room(layout.size_bytes * (num_slots - index))
                memory = shared_memory.SharedMemory(
                    name=f"rlpipe_{shelf_id[:16]}_{index}", create=True, size=layout.size_bytes
                )
                memories.append(memory)
                flat = torch.frombuffer(memory.buf, dtype=torch.uint8, count=layout.size_bytes)
                slots.append(SharedSlot(size_bytes=layout.size_bytes, shm_name=memory.name))
            else:
                raise ValueError(f"cannot share weights on {device}")
            _header(flat).fill_(WRITING)
            flats.append(flat)
        description = SameHostShelf(
            shelf_id=shelf_id,
            host_id=host_id,
            kind="cuda_ipc" if device.type == "cuda" else "posix_shm",
            device_uuid=_device_uuid(device),
            slots=slots,
            tensors=layout.tensors,
            created_at=time.time(),
        )
        return cls(description, flats, memories)

    def fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether `state` has the shelf's names, dtypes and shapes, in its order."""
        return _layout(state).tensors == self.description.tensors

    def write(
        self,
        state: Mapping[str, torch.Tensor],
        version: int,
        step: int | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> SameHostVersion:
        """Copy `state` into the next slot and return its notice; blocks until the copy is
        complete (the caller publishes the notice only then). On a card, `ready` is an event
        recorded where `state` was made (the copy waits for it, and for nothing else that
        stream runs later); without it the copy waits for all of that stream's work so far.
        The caller keeps `state` alive until write returns."""
        if not self.fits(state):
            raise ValueError("the state's names, dtypes or shapes differ from the shelf's")
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._flats)
        flat, views = self._flats[index], self._views[index]
        header = _header(flat)
        stream = self._stream
        if stream is not None:
            if ready is None:
                stream.wait_stream(torch.cuda.current_stream(flat.device))
            else:
                stream.wait_event(ready)
        with torch.no_grad(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            header.fill_(WRITING)
            _synchronize(stream)  # a reader that meets the old version must see it change
            destinations = [views[name] for name in state]
            torch._foreach_copy_(destinations, list(state.values()))
            total = checksum(destinations)  # synchronizes: the copy is complete
            header.fill_(version)
            _synchronize(stream)
        return SameHostVersion(
            shelf_id=self.description.shelf_id,
            version=version,
            slot=index,
            checksum=total,
            step=step,
            published_at=time.time(),
        )

    def close(self) -> None:
        """Release the slots (a POSIX block is unlinked; workers mapping it keep their map)."""
        self._views.clear()
        self._flats.clear()
        for memory in self._memories:
            with contextlib.suppress(FileNotFoundError):
                memory.unlink()
            with contextlib.suppress(BufferError):
                memory.close()
        self._memories.clear()


class ShelfReader:
    """A worker's map of its host trainer's shelf."""

    def __init__(
        self, description: SameHostShelf, flats: list[torch.Tensor], memories: list[mmap.mmap]
    ) -> None:
        self.description = description
        self._flats = flats
        self._memories = memories
        self._views = [_views(flat, description.tensors) for flat in flats]

    @classmethod
    def open(cls, description: SameHostShelf) -> ShelfReader:
        """Map every slot; SameHostUnavailable when this process cannot."""
        flats, memories = [], []
        try:
            if description.kind == "cuda_ipc":
                device = _device_with_uuid(description.device_uuid)
                flats = [_open_cuda_slot(slot, device) for slot in description.slots]
            else:
                for slot in description.slots:
                    assert slot.shm_name is not None, "a POSIX slot has a name"
                    memory = _map_shm(slot.shm_name, slot.size_bytes)
                    memories.append(memory)
                    flats.append(torch.frombuffer(memory, dtype=torch.uint8, count=slot.size_bytes))
        except (OSError, RuntimeError, ValueError) as exc:
            raise SameHostUnavailable(
                f"cannot map shelf {description.shelf_id} of host {description.host_id} "
                f"({description.kind}): {type(exc).__name__}: {exc}"
            ) from exc
        return cls(description, flats, memories)

    def copy_into(
        self, live: Mapping[str, torch.Tensor], notice: SameHostVersion, verify: bool = True
    ) -> None:
        """Copy the notice's version into `live` (same names, dtypes and shapes); raises
        TornCopyError when the slot did not hold that version throughout, and
        ChecksumMismatchError (with `verify`) when the copy does not sum to the notice's."""
        if notice.shelf_id != self.description.shelf_id:
            raise ValueError(f"the notice is of shelf {notice.shelf_id}, not this reader's")
        flat, views = self._flats[notice.slot], self._views[notice.slot]
        header = _header(flat)
        held = int(header.item())
        if held != notice.version:
            raise TornCopyError(f"slot {notice.slot} holds version {held}, not {notice.version}")
        missing = [name for name in views if name not in live]
        if missing:
            raise ValueError(f"the engine has no tensor {missing[0]!r} of the trainer's weights")
        destinations = [live[name] for name in views]
        with torch.no_grad():
            torch._foreach_copy_(destinations, list(views.values()))
        for destination in {t.device for t in destinations}:
            if destination.type == "cuda":
                torch.cuda.synchronize(destination)
        after = int(header.item())
        if after != notice.version:
            raise TornCopyError(
                f"slot {notice.slot} was rewritten (version {after}) while version "
                f"{notice.version} was copied"
            )
        if verify and checksum(destinations) != notice.checksum:
            raise ChecksumMismatchError(
                f"version {notice.version} copied from slot {notice.slot} does not match the "
                "trainer's checksum"
            )

    def close(self) -> None:
        """Drop the maps."""
        self._views.clear()
        self._flats.clear()
        for memory in self._memories:
            with contextlib.suppress(BufferError):
                memory.close()
        self._memories.clear()


def _map_shm(name: str, size_bytes: int) -> mmap.mmap:
    """Map the trainer's POSIX block (not through SharedMemory: Python 3.11 would register a
    block it only opened, and unlink the trainer's when this process exits)."""
    descriptor = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDWR)
    try:
        return mmap.mmap(descriptor, size_bytes)
    finally:
        os.close(descriptor)


def _check_room(size_bytes: int) -> None:
    """OSError when /dev/shm cannot hold `size_bytes` more: a block past it is created
    sparse and the first write into it kills the process (SIGBUS), e.g. in a container whose
    /dev/shm is the default 64 MB."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm to ask (another platform): creating the block decides
        return
    free = stats.f_bavail * stats.f_frsize
    if free < size_bytes:
        raise OSError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the shelf needs "
            f"{size_bytes / 2**20:.0f} MiB more (raise its size, or same_host.enabled=false)"
        )


def _synchronize(stream: torch.cuda.Stream | None) -> None:
    """Wait for a slot's writes so far (its own stream on a card; a CPU copy is done)."""
    if stream is not None:
        stream.synchronize()


def _device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_with_uuid(device_uuid: str) -> torch.device:
    """The local index of the card with this UUID; SameHostUnavailable when none is visible."""
    if not torch.cuda.is_available():
        raise SameHostUnavailable("the shelf is on a GPU and this process sees none")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return torch.device("cuda", index)
    raise SameHostUnavailable(f"the shelf's card {device_uuid} is not visible to this process")


def _cuda_slot(flat: torch.Tensor) -> SharedSlot:
    """The IPC description of a slot allocated on a card."""
    (
        _device,
        handle,
        _storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = flat.untyped_storage()._share_cuda_()
    return SharedSlot(
        size_bytes=flat.numel(),
        cuda_handle=handle,
        cuda_offset_bytes=storage_offset,
        cuda_ref_counter_handle=ref_counter_handle,
        cuda_ref_counter_offset=ref_counter_offset,
        cuda_event_handle=event_handle,
        cuda_event_sync_required=event_sync_required,
    )


def _open_cuda_slot(slot: SharedSlot, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a slot of another process's card memory."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        slot.cuda_handle,
        slot.size_bytes,
        slot.cuda_offset_bytes,
        slot.cuda_ref_counter_handle,
        slot.cuda_ref_counter_offset,
        slot.cuda_event_handle,
        slot.cuda_event_sync_required,
    )
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage, 0, (slot.size_bytes,), (1,))
    return flat
