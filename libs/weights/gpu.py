"""The delta codec on the GPU, the diff side: find changes where the weights live.

`device_changes(base, new)` compares two tensors of any torch device on their bit patterns
(an integer view of the same width: never float compares, so NaN payloads and -0.0 count as
they are), and copies only the changed positions and their old and new bits to the host.
`device_diff` does that for a whole state with a few waits on the device in all (one flat
mask and one `nonzero` per element width, one packed transfer) rather than one per tensor.
`encode_device(base, new, mirror, ...)` turns those into the same manifest and chunks, byte
for byte, as `encode` on host copies: the existing CPU entropy coder does the rest. `mirror`
is a host copy of the base that the caller keeps (the trainer side's copy of the last
version): it becomes the target, by a full copy into a spare pinned buffer where the caller
keeps one (a DMA at bus speed) or patched with the changes, and is hashed there. The apply
side is `libs.weights.gpu_apply`. Every function also runs on CPU torch tensors, which is how
the tests check it without a GPU.

    manifest, chunks = encode_device(base, new, mirror, base_version=2, version=3)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from libs.weights.chunking import DENSE_BYTES_PER_WIDTH, TensorJob, dense_bytes_per_width
from libs.weights.encoder import (
    DENSE_FRACTION,
    DENSITY_SAMPLE,
    EncodeOptions,
    EncodeTimes,
    _finish,
)
from libs.weights.encodings import DenseCodes
from libs.weights.format import Change, Chunk, Manifest
from libs.weights.hashing import state_hash
from libs.weights.scan import Changes
from libs.weights.tensors import DTYPE_WIDTHS, RawTensor, _torch_dtypes, as_raw, unsigned_dtype

# Element width in bytes -> the integer dtype whose view holds a tensor's bit patterns.
INT_VIEWS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """`device_changes` of the named tensors, found together so the host waits on the device
    twice per element width and once more, whatever the number of tensors: the tensors of
    one device and width are compared into one flat mask searched by one `nonzero`, each
    tensor's share of the hits is read in one transfer, and every change crosses to the host
    in one packed copy: a wait per tensor (byte-0.5b has 399) costs more than the diff."""
    groups: dict[tuple[torch.device, int], list[str]] = {}
    for name in names:
        key = (new[name].device, new[name].element_size())
        groups.setdefault(key, []).append(name)
    pending: list[tuple[str, int, int, bool]] = []  # name, count, width, narrow (packed order)
    parts: list[torch.Tensor] = []
    for (device, width), members in groups.items():
        found = _group_changes(base, new, members, device)
        for name, (local, old_bits, new_bits) in zip(members, found, strict=True):
            narrow = width < 8 and old_bits.numel() < 1 << 31
            parts += [
                (local.to(torch.int32) if narrow else local).view(torch.uint8),
                old_bits[local].view(torch.uint8),
                new_bits[local].view(torch.uint8),
            ]
            pad = -_packed_bytes(local.numel(), width, narrow) % 8  # next one aligned
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            pending.append((name, local.numel(), width, narrow))
    if not pending:
        return {}
    host = host_bytes(parts)
    out: dict[str, Changes] = {}
    at = 0
    for name, count, width, narrow in pending:
        size = _packed_bytes(count, width, narrow)
        out[name] = _unpack(host[at : at + size], count, width, narrow)
        at += size + -size % 8
    return out


def _packed_bytes(count: int, width: int, narrow: bool) -> int:
    """Bytes of `count` changes packed: positions, old bits, new bits."""
    return count * ((4 if narrow else 8) + 2 * width)


def _group_changes(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    names: list[str],
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For tensors of one device and width: each one's changed positions (int64, sorted,
    on the device) and its old and new integer views."""
    views = []
    for name in names:
        assert base[name].dtype == new[name].dtype and base[name].shape == new[name].shape, name
        views.append((int_view(base[name].contiguous()), int_view(new[name].contiguous())))
    starts = [0]
    for old_bits, _ in views:
        starts.append(starts[-1] + old_bits.numel())
    mask = torch.empty(starts[-1], dtype=torch.bool, device=device)
    for (old_bits, new_bits), start in zip(views, starts, strict=False):
        torch.ne(old_bits, new_bits, out=mask[start : start + old_bits.numel()])
    hits = mask.nonzero().view(-1)  # sorted, int64; a wait
    del mask
    bounds = torch.searchsorted(hits, torch.tensor(starts, device=device)).tolist()  # another
    return [
        (hits[bounds[i] : bounds[i + 1]] - starts[i], old_bits, new_bits)
        for i, (old_bits, new_bits) in enumerate(views)
    ]


def host_bytes(parts: list[torch.Tensor]) -> np.ndarray:
    """The bytes of `parts` (uint8 tensors of one device) concatenated, as a host array: one
    copy, into pinned memory from a GPU."""
    packed = torch.cat(parts)
    if not packed.is_cuda:
        return packed.numpy()
    host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    torch.cuda.current_stream(packed.device).synchronize()  # the one wait of the copy
    return host.numpy()


def _unpack(data: np.ndarray, count: int, width: int, narrow: bool) -> Changes:
    """Changes from packed bytes: positions, then old bits, then new bits."""
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
    times: EncodeTimes | None = None,
) -> tuple[Manifest, list[Chunk]]:
    """Delta of `new` against `base` (torch tensors on any device), as `encode` makes it.

    `mirror` holds the base's bytes on the host (numpy arrays or CPU tensors, writable, e.g.
    the previous call's mirror); afterwards it holds `new`'s. `base_hash` (the base's version
    hash) is computed from the mirror when not given.

    `spare` holds host tensors (pinned, for a GPU state) that tensors are copied into whole
    when one of their name, dtype and shape is there; afterwards it holds the mirror's
    previous tensors of those names, for the next call. Tensors without one are patched in
    the mirror with their changes (only those cross to the host), except dense deltas, which
    are copied fresh.
    """
    opts = options or EncodeOptions()
    if base_hash is None:
        base_hash = state_hash({n: as_raw(mirror[n]) for n in base}, opts.threads)
    started = time.perf_counter()
    dense, target, changes, copies, jobs = device_jobs(base, new, mirror, spare)
    if times is not None:
        times.diff_s = time.perf_counter() - started
    removed = [name for name in base if name not in new]
    for name in removed:
        mirror.pop(name, None)
    sources: dict[str, RawTensor | DenseCodes] = {**dense, **device_codes(base, new, dense)}
    encoded = _finish(
        sources, target, jobs, changes, removed, base_version, base_hash, version, opts
    )
    if spare is not None:  # the base bytes of the dense tensors are free for the next copy
        spare.update({n: mirror[n] for n in copies if isinstance(mirror[n], torch.Tensor)})
    mirror.update(copies)  # the mirror now holds the target of every tensor
    return encoded


# Widths whose dense_add codes are packed on the device (bf16, fp16, fp32), and the integer
# type wide enough for an element's difference there.
_WIDER = {2: torch.int32, 4: torch.int64}


def dense_add_codes(
    base: torch.Tensor, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`encodings.pack_codes(zigzag(new - base))` where the tensors are: the packed 2-bit
    symbols (uint8), the escaped elements' positions (int64) and their code - 3 (the
    tensors' integer view), computed in a wider integer type, so no step relies on how a
    narrow signed type overflows."""
    old_bits, new_bits = int_view(base.contiguous()), int_view(new.contiguous())
    codes = _zigzag_codes(old_bits, new_bits)
    packed = torch.empty((codes.numel() + 3) // 4, dtype=torch.uint8, device=codes.device)
    _pack_symbols(codes, packed)
    positions = (codes >= 3).nonzero().view(-1)  # a wait
    return packed, positions, _escapes(old_bits, new_bits, positions)


def _zigzag_codes(old_bits: torch.Tensor, new_bits: torch.Tensor) -> torch.Tensor:
    """zigzag((new - old) mod 2^bits) of integer views, in the wider type: in [0, 2^bits)."""
    width = old_bits.element_size()
    wide, bits = _WIDER[width], 8 * width
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    diff = (new_bits.to(wide) - old_bits.to(wide)) & mask
    signed = ((diff + half) & mask) - half
    return (signed << 1) ^ (signed >> (bits - 1))


def _pack_symbols(codes: torch.Tensor, out: torch.Tensor) -> None:
    """The codes clamped to 3, as 2-bit symbols packed 4 per byte into `out`."""
    symbols = torch.zeros(out.numel() * 4, dtype=torch.uint8, device=codes.device)
    symbols[: codes.numel()] = codes.clamp(max=3).to(torch.uint8)
    quads = symbols.view(-1, 4)
    torch.bitwise_or(
        quads[:, 0] | (quads[:, 1] << 2), (quads[:, 2] << 4) | (quads[:, 3] << 6), out=out
    )


def _escapes(old_bits: torch.Tensor, new_bits: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """code - 3 of the escaped elements `at`, in the tensors' integer view."""
    bits = 8 * old_bits.element_size()
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    codes = _zigzag_codes(old_bits[at], new_bits[at])
    return (((codes - 3 + half) & mask) - half).to(old_bits.dtype)


# Dense tensors of fewer elements are coded on the host from the copies there: on the device
# each costs a dozen kernel launches (byte-0.5b's 99 biases at lr 1e-6 took 0.04 s there).
DEVICE_CODES_MIN_ELEMENTS = 1 << 16
# Elements whose dense_add codes are found in one batch: one search for escapes and one copy
# to the host per batch, not per tensor (byte-3b has 252 dense tensors in 2.8G elements).
CODES_BATCH_ELEMENTS = 1 << 28


def device_codes(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], names: Mapping[str, Any]
) -> dict[str, DenseCodes]:
    """`dense_add_codes` of the named tensors of a width in _WIDER and at least
    DEVICE_CODES_MIN_ELEMENTS elements, on the host: the host then only compresses them
    (numpy's subtract, zigzag and symbol packing cost more than zstd there), and a quarter of
    a byte per element crosses to it, not two. Tensors are coded in batches of up to
    CODES_BATCH_ELEMENTS, each with two waits on the device."""
    batches: list[list[str]] = []
    size = 0
    for name in names:
        numel = new[name].numel()
        if new[name].element_size() not in _WIDER or numel < DEVICE_CODES_MIN_ELEMENTS:
            continue
        if not batches or size + numel > CODES_BATCH_ELEMENTS:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += numel
    out: dict[str, DenseCodes] = {}
    for batch in batches:
        out.update(_codes_batch(base, new, batch))
    return out


def _codes_batch(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, DenseCodes]:
    """`device_codes` of tensors of one device: every tensor's symbols packed into one
    buffer, its escapes marked in one flat mask searched by one `nonzero`, all of it read to
    the host in one copy."""
    device = new[names[0]].device
    views = [(int_view(base[n].contiguous()), int_view(new[n].contiguous())) for n in names]
    starts, packed_starts = [0], [0]
    for old_bits, _ in views:
        starts.append(starts[-1] + old_bits.numel())
        packed_starts.append(packed_starts[-1] + (old_bits.numel() + 3) // 4)
    packed = torch.empty(packed_starts[-1], dtype=torch.uint8, device=device)
    escaped = torch.empty(starts[-1], dtype=torch.bool, device=device)
    for i, (old_bits, new_bits) in enumerate(views):
        codes = _zigzag_codes(old_bits, new_bits)
        _pack_symbols(codes, packed[packed_starts[i] : packed_starts[i + 1]])
        torch.ge(codes, 3, out=escaped[starts[i] : starts[i + 1]])
        del codes
    hits = escaped.nonzero().view(-1)  # a wait
    del escaped
    bounds = torch.searchsorted(hits, torch.tensor(starts, device=device)).tolist()  # another
    positions = [hits[bounds[i] : bounds[i + 1]] - starts[i] for i in range(len(names))]
    escapes = [_escapes(o, n, at) for (o, n), at in zip(views, positions, strict=True)]
    host = host_arrays([packed, *positions, *escapes])
    packed_h, positions_h, escapes_h = host[0], host[1 : len(names) + 1], host[len(names) + 1 :]
    out: dict[str, DenseCodes] = {}
    for i, name in enumerate(names):
        kind = unsigned_dtype(new[name].element_size())
        out[name] = DenseCodes(
            packed_h[packed_starts[i] : packed_starts[i + 1]],
            positions_h[i].view(np.int64),
            escapes_h[i].view(kind),
            new[name].numel(),
        )
    return out


def host_arrays(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Tensors of one device as host arrays of their bytes (uint8), in one packed copy."""
    parts = []
    for tensor in tensors:
        parts.append(tensor.reshape(-1).view(torch.uint8))
        if pad := -parts[-1].numel() % 8:  # the next one aligned
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=tensor.device))
    host = host_bytes(parts)
    out, at = [], 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        out.append(host[at : at + size])
        at += size + -size % 8
    return out


def device_jobs(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    mirror: MutableMapping[str, Any],
    spare: MutableMapping[str, torch.Tensor] | None = None,
) -> tuple[
    dict[str, RawTensor],
    dict[str, RawTensor],
    dict[str, Change],
    dict[str, torch.Tensor],
    list[TensorJob],
]:
    """`encode_device`'s work before the entropy coder: the dense deltas' bases, the target
    of every tensor on the host (fresh copies, or the mirror patched with the changes), each
    tensor's change, the fresh copies, and the jobs in manifest order, as `encode` plans them.
    The mirror is patched in place; `encode_device` adopts the copies into it afterwards."""
    target, changes = _host_targets(base, new, mirror)
    costs: dict[str, float] = {}
    dense = _dense_deltas(base, new, target, changes, costs)
    copies = _host_copies(new, [n for n in target if changes.get(n) != "whole"], dense, spare)
    target.update({name: as_raw(copy) for name, copy in copies.items()})
    found = device_diff(base, new, [n for n in new if n not in changes])
    jobs: list[TensorJob] = []
    for name, raw in target.items():
        if name in found:
            if name not in copies:  # no fresh host copy: patch the mirror
                raw.units()[found[name].positions] = found[name].new
            changes[name] = "delta" if found[name].positions.size else "same"
        if changes[name] != "same":
            cost = costs.get(name, DENSE_BYTES_PER_WIDTH)
            jobs.append(TensorJob(name, raw.width, raw.numel, found.get(name), name in dense, cost))
    return dense, target, changes, copies, jobs


def _dense_deltas(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    target: dict[str, RawTensor],
    changes: dict[str, Change],
    costs: dict[str, float],
) -> dict[str, RawTensor]:
    """The tensors `encode` sends as dense deltas (sampled density, compared on the device),
    marked in `changes`, their size estimates in `costs`: every element crosses to the host
    anyway. Returns their bases, the mirror's bytes (`target` still holds them), by name."""
    densities = _device_densities(base, new, [n for n in new if n not in changes])
    bases: dict[str, RawTensor] = {}
    for name, density in densities.items():
        if density >= DENSE_FRACTION:
            bases[name] = target[name]
            changes[name] = "delta"
            costs[name] = dense_bytes_per_width(density)
    return bases


def _host_copies(
    new: Mapping[str, torch.Tensor],
    names: list[str],
    required: Mapping[str, Any],
    spare: MutableMapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Host copies of the named tensors, the mirror's next content: each one into its `spare`
    buffer when one of its dtype and shape is there (pinned: the copies run at full bus speed
    with one wait per device), else a fresh copy for the `required` ones (dense deltas);
    the rest are patched in the mirror with their changes instead.

    A full copy of byte-0.5b into pinned memory moves 1 GB over PCIe, which is still
    faster than patching the mirror with a demo-rate step's changes or a fresh pageable copy
    of just the dense tensors."""
    copies: dict[str, torch.Tensor] = {}
    waits: set[torch.device] = set()
    for name in names:
        tensor = new[name].detach()
        buffer = None if spare is None else spare.get(name)
        if buffer is not None and buffer.dtype == tensor.dtype and buffer.shape == tensor.shape:
            del spare[name]  # type: ignore[union-attr]
            asynchronous = tensor.is_cuda and buffer.is_pinned()  # waited for below
            copies[name] = buffer.copy_(tensor, non_blocking=asynchronous)
            if asynchronous:
                waits.add(tensor.device)
        elif name in required:
            copies[name] = tensor.to("cpu", copy=True).contiguous()
    for device in waits:
        torch.cuda.current_stream(device).synchronize()
    return copies


def _device_densities(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, float]:
    """`encoder.sampled_density` of each named tensor on its device (the same elements, the
    same fraction), read back in one transfer per device."""
    counts: dict[torch.device, list[tuple[str, torch.Tensor, int]]] = {}
    out: dict[str, float] = {}
    for name in names:
        old_bits, new_bits = int_view(base[name].contiguous()), int_view(new[name].contiguous())
        step = max(1, old_bits.numel() // DENSITY_SAMPLE)
        sample_old, sample_new = old_bits[::step], new_bits[::step]
        if not sample_old.numel():
            out[name] = 0.0
            continue
        changed = torch.count_nonzero(sample_old != sample_new)
        counts.setdefault(changed.device, []).append((name, changed, sample_old.numel()))
    for found in counts.values():
        values = torch.stack([changed for _, changed, _ in found]).tolist()
        out.update({name: v / size for (name, _, size), v in zip(found, values, strict=True)})
    return {name: out[name] for name in names}


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
