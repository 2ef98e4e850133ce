"""Read and write safetensors files as raw bytes, for every dtype (bf16 and fp8 included).

Format: u64 LE header length, a JSON header {name: {dtype, shape, data_offsets}, optional
"__metadata__"}, then the tensor bytes. Reading memory-maps the file and keeps the exact
bytes; nothing is converted.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from libs.durable_files import publish_durably
from libs.weights.tensors import RawTensor, check_dtype

_MAX_HEADER_BYTES = 100 << 20


def read_safetensors(path: str | Path) -> dict[str, RawTensor]:
    """Tensors of a safetensors file in file order, as read-only RawTensors (memory-mapped)."""
    data = (
        np.memmap(path, dtype=np.uint8, mode="r")
        if Path(path).stat().st_size
        else np.zeros(0, np.uint8)
    )
    if data.size < 8:
        raise ValueError(f"{path}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", data[:8].tobytes())
    if length > min(_MAX_HEADER_BYTES, data.size - 8):
        raise ValueError(f"{path}: bad safetensors header length {length}")
    try:
        header = json.loads(data[8 : 8 + length].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: safetensors header is not JSON: {exc}") from exc
    body = data[8 + length :]
    entries = [(n, e) for n, e in header.items() if n != "__metadata__"]
    entries.sort(key=lambda item: item[1]["data_offsets"][0])
    return {name: _tensor(path, name, entry, body) for name, entry in entries}


def _tensor(path: str | Path, name: str, entry: dict, body: np.ndarray) -> RawTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        width = check_dtype(dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad header entry for {name!r}: {exc}") from exc
    numel = int(np.prod(shape, dtype=np.int64))
    if not 0 <= begin <= end <= body.size or end - begin != numel * width:
        raise ValueError(
            f"{path}: tensor {name!r} offsets {begin}..{end} do not fit {dtype}{list(shape)}"
        )
    return RawTensor(dtype, shape, body[begin:end])


def write_safetensors(path: str | Path, state: Mapping[str, RawTensor]) -> None:
    """Write RawTensors as a safetensors file, in the given order (via a temporary name)."""
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in state.items():
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.data.size],
        }
        offset += tensor.data.size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8-byte alignment
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for tensor in state.values():
            out.write(tensor.data.data)
    publish_durably(partial, target)
