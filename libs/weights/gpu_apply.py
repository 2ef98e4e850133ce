"""The delta codec on the GPU, the apply side: deltas written where the weights live.

`DeviceDeltaApplier` is the codec's DeltaApplier for a state of device tensors. `prepare`
gathers the old bits at the changed positions from the device, decodes and checks the chunk
on the host, and stages its positions and new bits on the device, each of the three in one
copy for all the chunk's pieces; `commit` (the pause a serving engine sees) is then one index
scatter per piece into the integer view of each tensor, in place, and a `copy_` for whole
tensors. It also runs on CPU torch tensors, which is how the tests check it without a GPU.

    applier = DeviceDeltaApplier(cuda_state, manifest, current)
    prepared = [applier.prepare(c) for c in chunks]      # while the engine serves
    for p in prepared: applier.commit(p)                  # the pause
    applier.finish()
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from libs.weights.applier import DeltaApplier, PreparedChunk
from libs.weights.encodings import Written, decode_piece
from libs.weights.errors import BaseMismatchError, CorruptDeltaError
from libs.weights.format import Encoding, Manifest, TensorEntry, VersionInfo
from libs.weights.gpu import INT_VIEWS, device_state_hash, host_bytes, int_view
from libs.weights.tensors import _torch_dtypes, unsigned_dtype

_NUMPY_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # INT_VIEWS, for numpy


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


@dataclass(frozen=True)
class StagedWrite:
    """What one piece writes, on the device: range-relative positions (None: all) and bits."""

    positions: torch.Tensor | None
    values: torch.Tensor


# Dense deltas of these element widths (bf16, fp16, fp32) are decoded on the device: the
# host only decompresses their streams and hashes what they write; the streams go up, the
# new values are computed there and come down once for the output hash. On the host numpy's
# unpacking, unzigzag and add cost more than zstd (bench/codec_threads.py).
DEVICE_DECODED_WIDTHS = (2, 4)
_WIDER = {2: torch.int32, 4: torch.int64}  # room for an unsigned element and a difference


# Dense pieces of fewer elements are decoded on the host: on the device each costs a dozen
# kernel launches and a wait, more than numpy takes for it. At lr 1e-6 byte-0.5b's biases
# are 99 dense pieces of 128-896 elements, and the receive spent a third of its time on them.
DEVICE_DECODE_MIN_ELEMENTS = 1 << 16


def decoded_on_device(encoding: str, width: int, size: int) -> bool:
    """Whether `DeviceDeltaApplier` decodes a piece of this encoding, element width and
    number of elements on its device."""
    return (
        encoding in ("dense_add", "dense_xor")
        and width in DEVICE_DECODED_WIDTHS
        and size >= DEVICE_DECODE_MIN_ELEMENTS
    )


def dense_on_device(encoding: str, streams: list[torch.Tensor], old: torch.Tensor) -> torch.Tensor:
    """The new bits of a dense piece from its streams (uint8 device tensors, checked by
    `checked_streams`) and the old bits `old` (a signed integer view): old ^ the byte planes
    (dense_xor), or old + unzigzag(codes) modulo 2^bits, the codes unpacked from the 2-bit
    symbols and escape planes (dense_add). Exact integer arithmetic in a wider type, so no
    step relies on how a narrow signed type overflows."""
    width = old.element_size()
    if encoding == "dense_xor":
        return old ^ torch.stack(streams, dim=1).reshape(-1).view(old.dtype)
    wide, bits = _WIDER[width], 8 * width
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    codes = _symbols(streams[0], old.numel()).to(wide)
    escaped = (codes == 3).nonzero().view(-1)  # a wait
    escapes = torch.stack(streams[1:], dim=1).reshape(-1).view(old.dtype)
    if escaped.numel() != escapes.numel():
        raise CorruptDeltaError(
            f"{escaped.numel()} escaped symbols, {escapes.numel()} escapes in the stream"
        )
    codes[escaped] = (escapes.to(wide) & mask) + 3
    delta = (codes >> 1) ^ -(codes & 1)
    unsigned = (old.to(wide) + delta) & mask
    return ((unsigned + half) & mask).sub_(half).to(old.dtype)


def _symbols(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` 2-bit symbols of packed bytes (element 4i + k: bits 2k, 2k + 1 of
    byte i), as uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:count]


def checked_streams(encoding: str, raw: list[np.ndarray], size: int, width: int) -> list:
    """A dense piece's streams, checked against its range: `width` byte planes of `size`
    bytes (dense_xor), or the packed symbols of `size` elements and `width` escape planes
    of one size (dense_add)."""
    sizes = [int(stream.size) for stream in raw]
    if encoding == "dense_xor":
        fits = sizes == [size] * width
    else:
        fits = len(sizes) == 1 + width and sizes[0] == (size + 3) // 4
        fits = fits and len(set(sizes[1:])) == 1
    if not fits:
        raise CorruptDeltaError(f"{encoding} streams of {sizes} bytes for {size} elements")
    return raw


@dataclass(frozen=True)
class _DeviceWritten(Written):
    """What a piece decoded on the device writes: the bits there (`values` holds them on the
    host, for the output hash)."""

    device_values: torch.Tensor | None = None


@dataclass(frozen=True)
class _Fetched:
    """A GpuRange with the old values a piece decodes against, read ahead with the rest of
    its chunk's (`old`: the values at `positions`, or the whole range for a dense delta;
    None for a raw piece), and its positions already on the device."""

    range: GpuRange
    positions: np.ndarray | None
    device_positions: torch.Tensor | None
    old: np.ndarray | None
    decoded: torch.Tensor | None = None  # a piece decoded on the device: its new bits there
    decoded_host: np.ndarray | None = None  # and on the host, for the output hash

    @property
    def width(self) -> int:
        return self.range.width

    @property
    def size(self) -> int:
        return self.range.size

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """The values read ahead (read now if asked for other positions)."""
        if positions is self.positions and self.old is not None:
            return self.old
        return self.range.gather(positions)

    def read_all(self) -> np.ndarray:
        """The whole range, as read ahead."""
        if self.positions is None and self.old is not None:
            return self.old
        return self.range.read_all()


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays on the device, as uint8 tensors, in one copy (through pinned memory from
    a GPU); each starts 8-byte aligned so it can be viewed as any integer type."""
    if not arrays:
        return []
    sizes = [a.nbytes for a in arrays]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size + -size % 8)
    host = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    buffer = host.numpy()
    for array, start, size in zip(arrays, starts, sizes, strict=False):
        buffer[start : start + size] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    staged = host.to(device, non_blocking=True)
    return [staged[start : start + size] for start, size in zip(starts, sizes, strict=False)]


def _download(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Device integer tensors as host arrays of their width's uint dtype, in one copy."""
    if not tensors:
        return []
    parts: list[torch.Tensor] = []
    for tensor in tensors:
        parts.append(tensor.reshape(-1).view(torch.uint8))
        if pad := -parts[-1].numel() % 8:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=tensor.device))
    host = host_bytes(parts)
    out, at = [], 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        out.append(host[at : at + size].view(unsigned_dtype(tensor.element_size())))
        at += size + -size % 8
    return out


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

    def _read_targets(
        self,
        ranges: list[Any],
        positions: list[np.ndarray | None],
        encodings: list[str],
        streams: list[list[np.ndarray]],
    ) -> list[Any]:
        """The chunk's ranges with the old values its pieces decode against, read from the
        device together, and its dense pieces of a device-decoded width decoded there: the
        positions and those pieces' streams go up in one copy, the old values and those
        pieces' new values (for the output hash) come down in one."""
        if not ranges:
            return []
        on_device = [
            decoded_on_device(e, r.width, r.size) for r, e in zip(ranges, encodings, strict=True)
        ]
        sent: list[np.ndarray] = []
        for target, encoding, raw, decoded in zip(
            ranges, encodings, streams, on_device, strict=True
        ):
            if decoded:
                sent += checked_streams(encoding, raw, target.size, target.width)
        staged = iter(upload([p for p in positions if p is not None] + sent, self.device))
        device_positions = [
            None if p is None else next(staged).view(torch.int64) for p in positions
        ]
        news = [
            dense_on_device(e, [next(staged) for _ in raw], t._view()) if d else None
            for t, e, raw, d in zip(ranges, encodings, streams, on_device, strict=True)
        ]
        reads: list[torch.Tensor] = []
        for target, at, encoding, new in zip(
            ranges, device_positions, encodings, news, strict=True
        ):
            if at is not None:
                reads.append(target._view()[at])
            elif new is not None:
                reads.append(new)
            elif encoding != "raw":  # a dense delta decoded on the host reads its whole range
                reads.append(target._view())
        hosts = iter(_download(reads))
        fetched = []
        for target, host, at, encoding, new in zip(
            ranges, positions, device_positions, encodings, news, strict=True
        ):
            read = next(hosts) if at is not None or encoding != "raw" else None
            if new is not None:
                fetched.append(_Fetched(target, host, at, None, new, read))
            else:
                fetched.append(_Fetched(target, host, at, read))
        return fetched

    def _decode_piece(
        self,
        encoding: Encoding,
        raw: list[np.ndarray],
        target: Any,
        num_changed: int,
        positions: np.ndarray | None,
    ) -> Written:
        """A piece decoded on the device by `_read_targets` as it is there; the rest on the
        host."""
        if isinstance(target, _Fetched) and target.decoded is not None:
            assert target.decoded_host is not None
            return _DeviceWritten(None, target.decoded_host, target.decoded)
        return decode_piece(encoding, raw, target, num_changed, positions)

    def _prepared(self, index: int, writes: list[tuple[Any, Any]]) -> DevicePreparedChunk:
        """Stage the decoded writes on the device, every piece's values in one copy (the
        positions are there already)."""
        on_host = [w.values for _, w in writes if not isinstance(w, _DeviceWritten)]
        uploaded = iter(upload(on_host, self.device))
        staged: list[tuple[Any, Any]] = []
        for fetched, written in writes:
            target = fetched.range
            if isinstance(written, _DeviceWritten) and written.device_values is not None:
                bits = written.device_values  # decoded there: not uploaded again
            else:
                bits = next(uploaded).view(INT_VIEWS[target.width])
            positions = None
            if written.positions is not None:
                positions = fetched.device_positions
                if written.positions is not fetched.positions:  # not what was read ahead
                    positions = _to_device(written.positions, self.device)
            staged.append((target, StagedWrite(positions, bits)))
        if self.device.type == "cuda":  # the staging copies are done before commit
            torch.cuda.current_stream(self.device).synchronize()
        return DevicePreparedChunk(index, staged)

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
