"""The delta codec on the GPU: find changes and apply deltas where the weights live.

Diff: `device_changes(base, new)` compares two tensors of any torch device on their bit
patterns (an integer view of the same width: never float compares, so NaN payloads and
-0.0 count as they are), and copies only the changed positions and their old and new bits
to the host, one packed transfer per tensor. `encode_device(base, new, mirror, ...)` turns
those into the same manifest and chunks, byte for byte, as `encode` on host copies: the
existing CPU entropy coder does the rest. `mirror` is a host copy of the base that the
caller keeps (the trainer side's copy of the last version): it is patched to the target
with the changes and hashed there, so whole tensors never cross PCIe for a delta.

Apply: `DeviceDeltaApplier` is the codec's DeltaApplier for a state of device tensors.
`prepare` gathers the old bits at the changed positions from the device, decodes and checks
the chunk on the host, and stages its positions and new bits on the device; `commit` (the
pause a serving engine sees) is then one index scatter per piece into the integer view of
each tensor, in place, and a `copy_` for whole tensors. Every function also runs on CPU
torch tensors, which is how the tests check it without a GPU.

    manifest, chunks = encode_device(base, new, mirror, base_version=2, version=3)
    applier = DeviceDeltaApplier(cuda_state, manifest, current)
    prepared = [applier.prepare(c) for c in chunks]      # while the engine serves
    for p in prepared: applier.commit(p)                  # the pause
    applier.finish()
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from libs.weights.applier import DeltaApplier, PreparedChunk
from libs.weights.chunking import TensorJob
from libs.weights.encoder import DENSE_FRACTION, DENSITY_SAMPLE, EncodeOptions, _finish
from libs.weights.encodings import Written
from libs.weights.errors import BaseMismatchError, CorruptDeltaError
from libs.weights.format import Change, Chunk, Manifest, TensorEntry, VersionInfo
from libs.weights.hashing import state_hash
from libs.weights.scan import Changes
from libs.weights.tensors import DTYPE_WIDTHS, RawTensor, _torch_dtypes, as_raw, unsigned_dtype

# Element width in bytes -> the integer dtype whose view holds a tensor's bit patterns.
INT_VIEWS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # same, for from_numpy


def dtype_name(tensor: torch.Tensor) -> str:
    """The safetensors dtype name of a torch tensor, or ValueError naming the dtype."""
    names = {dtype: name for name, dtype in _torch_dtypes().items()}
    if tensor.dtype not in names:
        raise ValueError(f"unsupported torch dtype {tensor.dtype}; supported: {list(names)}")
    return names[tensor.dtype]


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as flat integers of the same width, sharing its memory."""
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous; the codec writes and reads it in place")
    width = DTYPE_WIDTHS[dtype_name(tensor)]
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if tensor.dtype == torch.bool else flat.view(INT_VIEWS[width])


def device_changes(base: torch.Tensor, new: torch.Tensor) -> Changes:
    """Changed elements of two same-shape, same-dtype tensors; only they reach the host.

    Positions are sorted, int32 when the tensor has fewer than 2^31 elements (int64 else, and
    for 8-byte dtypes, which keeps the packed transfer aligned); values are the host uint
    dtype of the width, as `scan.changed_elements` returns them.
    """
    return device_diff({"t": base}, {"t": new}, ["t"])["t"]


def device_diff(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, Changes]:
    """`device_changes` of the named tensors, each one's copy to the host (on a side stream
    on CUDA) overlapping the next one's compare."""
    side = None
    if names and new[names[0]].is_cuda:
        side = torch.cuda.Stream(new[names[0]].device)
    pending = [(name, *_launch(base[name], new[name], side)) for name in names]
    if side is not None:
        side.synchronize()
    return {
        name: _unpack(host, count, width, narrow) for name, host, count, width, narrow in pending
    }


def _launch(
    base: torch.Tensor, new: torch.Tensor, side: torch.cuda.Stream | None
) -> tuple[torch.Tensor, int, int, bool]:
    """Find the changes on the device and start their copy into one packed host buffer."""
    assert base.dtype == new.dtype and base.shape == new.shape, "compare like with like"
    old_bits, new_bits = int_view(base.contiguous()), int_view(new.contiguous())
    width = old_bits.element_size()
    positions = torch.ne(old_bits, new_bits).nonzero().view(-1)  # int64, sorted; syncs
    narrow = width < 8 and old_bits.numel() < 1 << 31
    packed = torch.cat(
        [
            (positions.to(torch.int32) if narrow else positions).view(torch.uint8),
            old_bits[positions].view(torch.uint8),
            new_bits[positions].view(torch.uint8),
        ]
    )
    if side is None:
        return packed.cpu(), positions.numel(), width, narrow
    side.wait_stream(torch.cuda.current_stream(packed.device))
    with torch.cuda.stream(side):
        host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        packed.record_stream(side)  # keep it alive until the copy is done
    return host, positions.numel(), width, narrow


def _unpack(host: torch.Tensor, count: int, width: int, narrow: bool) -> Changes:
    """Changes from a packed buffer: positions, then old bits, then new bits."""
    data = host.numpy()
    at = count * (4 if narrow else 8)
    kind = unsigned_dtype(width)
    return Changes(
        data[:at].view(np.int32 if narrow else np.int64),
        data[at : at + count * width].view(kind),
        data[at + count * width :].view(kind),
    )


def encode_device(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    mirror: MutableMapping[str, Any],
    *,
    base_version: int,
    version: int,
    options: EncodeOptions | None = None,
    base_hash: str | None = None,
    spare: MutableMapping[str, torch.Tensor] | None = None,
) -> tuple[Manifest, list[Chunk]]:
    """Delta of `new` against `base` (torch tensors on any device), as `encode` makes it.

    `mirror` holds the base's bytes on the host (numpy arrays or CPU tensors, writable, e.g.
    the previous call's mirror); it is patched in place into a host copy of `new`. Only the
    changed elements and the tensors that travel whole cross to the host. `base_hash`
    (the base's version hash) is computed from the mirror when not given.

    `spare` holds host tensors that the tensors sent as dense deltas are copied into when one
    of their name, dtype and shape is there (pinned, the copy runs at full bus speed: a fresh
    pageable copy of byte-0.5b's dense tensors took 0.6-0.9 s on an H200 host); afterwards
    it holds the mirror's previous tensors of those names, for the next call.
    """
    opts = options or EncodeOptions()
    if base_hash is None:
        base_hash = state_hash({n: as_raw(mirror[n]) for n in base}, opts.threads)
    target, changes = _host_targets(base, new, mirror)
    dense, copies = _dense_deltas(base, new, target, changes, spare)
    found = device_diff(base, new, [n for n in new if n not in changes])
    jobs: list[TensorJob] = []
    for name, raw in target.items():  # jobs in manifest order, as `encode` plans them
        if name in found:
            raw.units()[found[name].positions] = found[name].new
            changes[name] = "delta" if found[name].positions.size else "same"
        if changes[name] != "same":
            jobs.append(TensorJob(name, raw.width, raw.numel, found.get(name), name in dense))
    removed = [name for name in base if name not in new]
    for name in removed:
        mirror.pop(name, None)
    encoded = _finish(dense, target, jobs, changes, removed, base_version, base_hash, version, opts)
    if spare is not None:  # the base bytes of the dense tensors are free for the next copy
        spare.update({n: mirror[n] for n in copies if isinstance(mirror[n], torch.Tensor)})
    mirror.update(copies)  # the mirror now holds the target of every tensor
    return encoded


def _dense_deltas(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    target: dict[str, RawTensor],
    changes: dict[str, Change],
    spare: MutableMapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, RawTensor], dict[str, torch.Tensor]]:
    """The tensors `encode` sends as dense deltas (sampled density, compared on the device):
    every element crosses to the host anyway. Their host target becomes a copy of the new
    tensor (into its `spare` buffer if there is one) and the mirror's bytes the base they are
    encoded against; marked in `changes`. Returns those bases and the copies (the mirror's
    next content) by name."""
    bases: dict[str, RawTensor] = {}
    copies: dict[str, torch.Tensor] = {}
    for name, tensor in new.items():
        if name in changes or _device_density(base[name], tensor) < DENSE_FRACTION:
            continue
        bases[name] = target[name]
        buffer = None if spare is None else spare.pop(name, None)
        fits = buffer is not None and buffer.dtype == tensor.dtype and buffer.shape == tensor.shape
        if buffer is not None and fits:
            copies[name] = buffer.copy_(tensor.detach())
        else:
            copies[name] = tensor.detach().to("cpu", copy=True).contiguous()
        target[name] = as_raw(copies[name])
        changes[name] = "delta"
    return bases, copies


def _device_density(base: torch.Tensor, new: torch.Tensor) -> float:
    """`encoder.sampled_density` on device tensors: the same elements, the same fraction."""
    old_bits, new_bits = int_view(base.contiguous()), int_view(new.contiguous())
    step = max(1, old_bits.numel() // DENSITY_SAMPLE)
    sample_old, sample_new = old_bits[::step], new_bits[::step]
    if not sample_old.numel():
        return 0.0
    return int(torch.count_nonzero(sample_old != sample_new)) / sample_old.numel()


def _host_targets(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    mirror: MutableMapping[str, Any],
) -> tuple[dict[str, RawTensor], dict[str, Change]]:
    """The host tensors that will hold the target (in `new`'s order): the mirror's for deltas,
    fresh copies for tensors that travel whole (those are marked in the returned changes)."""
    target: dict[str, RawTensor] = {}
    changes: dict[str, Change] = {}
    for name, tensor in new.items():
        before = base.get(name)
        if before is None or before.dtype != tensor.dtype or before.shape != tensor.shape:
            mirror[name] = tensor.detach().to("cpu", copy=True).contiguous()
            target[name] = as_raw(mirror[name])
            changes[name] = "whole"
        else:
            target[name] = _mirror_of(mirror, name, tensor)
    return target, changes


def _mirror_of(mirror: Mapping[str, Any], name: str, tensor: torch.Tensor) -> RawTensor:
    """The writable host copy of a base tensor, checked against the device tensor."""
    if name not in mirror:
        raise ValueError(f"mirror lacks tensor {name!r}: it must hold the base version")
    raw = as_raw(mirror[name])
    if raw.dtype != dtype_name(tensor) or raw.shape != tuple(tensor.shape):
        raise ValueError(
            f"mirror holds {name!r} as {raw.dtype}{list(raw.shape)}, the base as "
            f"{dtype_name(tensor)}{list(tensor.shape)}: it must hold the base version"
        )
    if not raw.data.flags.writeable:
        raise ValueError(f"mirror tensor {name!r} is read-only; pass writable host copies")
    return raw


def device_state_hash(state: Mapping[str, Any], threads: int = 1) -> str:
    """Version hash of a state of torch tensors on any device (copies each to the host once)."""
    host = {n: t.detach().cpu() if isinstance(t, torch.Tensor) else t for n, t in state.items()}
    return state_hash({n: as_raw(t) for n, t in host.items()}, threads)


def on_device(state: Mapping[str, Any]) -> bool:
    """True when some tensor of the state is a torch tensor off the CPU."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in state.values())


# ---- apply --------------------------------------------------------------------------


def _to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host uint elements (or an already staged tensor) as device integers of the width."""
    if isinstance(values, torch.Tensor):
        return values.to(device)
    width = values.dtype.itemsize
    array = np.ascontiguousarray(values).view(_NUMPY_SIGNED[width])
    return torch.from_numpy(array).to(device, non_blocking=False)


@dataclass(frozen=True)
class GpuRange:
    """An ElementRange over elements [start, stop) of a torch tensor on any device.

    `bits` is the tensor's flat integer view (int_view). Reads return host arrays of the
    width's uint dtype; writes take host arrays or tensors already staged on the device.
    """

    bits: torch.Tensor
    start: int
    stop: int

    @property
    def width(self) -> int:
        """Element width in bytes."""
        return int(self.bits.element_size())

    @property
    def size(self) -> int:
        """Number of elements in the range."""
        return self.stop - self.start

    def _view(self) -> torch.Tensor:
        return self.bits[self.start : self.stop]

    def _host(self, values: torch.Tensor) -> np.ndarray:
        return values.cpu().numpy().view(unsigned_dtype(self.width))

    def gather(self, positions: np.ndarray | torch.Tensor) -> np.ndarray:
        """Current values at range-relative positions (a host array)."""
        index = _to_device(positions, self.bits.device)
        return self._host(self._view()[index])

    def read_all(self) -> np.ndarray:
        """Current values of the whole range (a host array)."""
        return self._host(self._view())

    def scatter(
        self, positions: np.ndarray | torch.Tensor, values: np.ndarray | torch.Tensor
    ) -> None:
        """Write values at range-relative positions, in place."""
        device = self.bits.device
        self._view()[_to_device(positions, device)] = _to_device(values, device)

    def write_all(self, values: np.ndarray | torch.Tensor) -> None:
        """Overwrite the whole range in place."""
        self._view().copy_(_to_device(values, self.bits.device))

    def stage(self, written: Written) -> StagedWrite:
        """`written` moved to the device, ready for scatter/write_all at commit."""
        device = self.bits.device
        positions = None if written.positions is None else _to_device(written.positions, device)
        return StagedWrite(positions, _to_device(written.values, device))


@dataclass(frozen=True)
class StagedWrite:
    """What one piece writes, on the device: range-relative positions (None: all) and bits."""

    positions: torch.Tensor | None
    values: torch.Tensor


@dataclass(frozen=True)
class DevicePreparedChunk(PreparedChunk):
    """A prepared chunk whose writes are staged on the device."""

    @property
    def num_written(self) -> int:
        """Elements this chunk writes."""
        return sum(int(w.values.numel()) for _, w in self.writes)


@dataclass(frozen=True)
class _DeviceTarget:
    """A tensor of the state that receives pieces: its dtype, shape and integer view."""

    dtype: str
    shape: tuple[int, ...]
    bits: torch.Tensor

    @property
    def numel(self) -> int:
        return int(self.bits.numel())


class DeviceDeltaApplier(DeltaApplier):
    """DeltaApplier for a state of torch tensors on a device (any device, CPU included).

    Writes land in place in the state's tensors (which must be contiguous); tensors a
    version adds are created on `device` (default: the device of the state's first tensor).
    """

    def __init__(
        self,
        state: MutableMapping[str, Any],
        manifest: Manifest,
        current: VersionInfo | None = None,
        kind: str = "auto",
        *,
        reuse_whole: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        """See DeltaApplier; `current` None hashes the state (one copy to the host)."""
        first = next(iter(state.values()), None)
        fallback = first.device if isinstance(first, torch.Tensor) else "cpu"
        self.device = torch.device(device if device is not None else fallback)
        if current is None and not manifest.is_snapshot:
            current = VersionInfo(version=None, hash=device_state_hash(state))
        super().__init__(state, manifest, current, kind, reuse_whole=reuse_whole)

    def _prepare(self, entry: TensorEntry) -> Any:
        """The target that receives this entry: the state's own tensor, or a new one."""
        dtype = _torch_dtypes()[entry.dtype]
        existing = self.state.get(entry.name)
        fits = (
            isinstance(existing, torch.Tensor)
            and existing.dtype == dtype
            and list(existing.shape) == entry.shape
        )
        if entry.change != "whole" or (self._reuse_whole and fits):
            if not isinstance(existing, torch.Tensor) or not fits:
                raise BaseMismatchError(
                    f"tensor {entry.name!r} is not a {entry.dtype}{entry.shape} torch tensor "
                    "in the base, as the delta expects"
                )
            return _DeviceTarget(entry.dtype, tuple(entry.shape), int_view(existing))
        tensor = torch.empty(entry.shape, dtype=dtype, device=self.device)
        self._added[entry.name] = tensor
        return _DeviceTarget(entry.dtype, tuple(entry.shape), int_view(tensor))

    def _range(self, name: str, start: int, stop: int) -> Any:
        target = self._raw.get(name)
        if target is None or not 0 <= start < stop <= target.numel:
            raise CorruptDeltaError(f"chunk piece {name!r}[{start}:{stop}] is not in the manifest")
        return GpuRange(target.bits, start, stop)  # type: ignore[attr-defined]

    def prepare(self, chunk: Chunk, *, check_payload: bool = True) -> DevicePreparedChunk:
        """Verify and decode one chunk (reads the state only), staging its writes on the device."""
        prepared = super().prepare(chunk, check_payload=check_payload)
        ranges: list[tuple[Any, Written]] = prepared.writes  # GpuRange targets (see _range)
        writes: list[tuple[Any, Any]] = [(t, t.stage(w)) for t, w in ranges]
        return DevicePreparedChunk(prepared.index, writes)

    def finish(self, verify_full: bool = False, threads: int = 1) -> VersionInfo:
        """As DeltaApplier.finish; waits for the device's writes, verifies on a host copy."""
        held = super().finish(False, threads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if verify_full:
            targets = {e.name: self.state[e.name] for e in self.manifest.tensors}
            if device_state_hash(targets, threads) != self.manifest.target_hash:
                raise CorruptDeltaError(
                    "the applied state does not match the manifest's target hash"
                )
        return held
