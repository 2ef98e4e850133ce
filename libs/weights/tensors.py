"""Raw tensor views: every tensor as (safetensors dtype name, shape, flat bytes).

The codec never does float arithmetic; it works on the exact bytes of each tensor viewed
as unsigned integers of the element width. This module converts numpy arrays and CPU torch
tensors to and from that view without copying where memory allows. Hosts are assumed
little-endian, the byte order safetensors stores. torch is imported only when a torch
tensor is seen or asked for, so the CLI starts fast.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

# safetensors dtype name -> element width in bytes.
DTYPE_WIDTHS: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32",
    "I64": "int64", "U64": "uint64", "F64": "float64",
}  # fmt: skip


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors name -> torch dtype (imports torch on first use)."""
    import torch

    return {name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items()}


def _is_torch(tensor: object) -> bool:
    """True for a torch tensor, without importing torch when nobody has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(tensor, torch.Tensor)


# numpy dtype name -> safetensors name (bf16/fp8 only through ml_dtypes, if a caller uses it).
_NUMPY_NAMES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "int64": "I64", "uint64": "U64", "float64": "F64",
    "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip
_NUMPY_BY_NAME = {v: k for k, v in _NUMPY_NAMES.items()}


@dataclass(frozen=True)
class RawTensor:
    """A tensor as safetensors sees it: dtype name, shape, and its bytes (flat uint8)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, shape (numel * width,), C order, little-endian elements

    @property
    def width(self) -> int:
        """Element width in bytes."""
        return DTYPE_WIDTHS[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.data.size // self.width

    def units(self) -> np.ndarray:
        """The elements as little-endian unsigned integers of the element width (a view)."""
        return self.data.view(unsigned_dtype(self.width))


TensorLike: TypeAlias = "np.ndarray | torch.Tensor | RawTensor"  # torch on CPU
State: TypeAlias = Mapping[str, Any]


def unsigned_dtype(width: int) -> np.dtype[Any]:
    """The little-endian unsigned integer numpy dtype of `width` bytes."""
    return np.dtype(f"<u{width}")


def check_dtype(dtype: str) -> int:
    """Return the width of a safetensors dtype name, or raise ValueError naming it."""
    if dtype not in DTYPE_WIDTHS:
        known = ", ".join(DTYPE_WIDTHS)
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {known}")
    return DTYPE_WIDTHS[dtype]


def as_raw(tensor: TensorLike) -> RawTensor:
    """View a numpy array, CPU torch tensor or RawTensor as a RawTensor (no copy if contiguous)."""
    if isinstance(tensor, RawTensor):
        return tensor
    if isinstance(tensor, np.ndarray):
        return _raw_from_numpy(tensor)
    if _is_torch(tensor):
        return _raw_from_torch(tensor)
    raise TypeError(f"expected a numpy array, torch tensor or RawTensor, got {type(tensor)!r}")


def _raw_from_torch(tensor: torch.Tensor) -> RawTensor:
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"tensor on {tensor.device}: the codec reads CPU tensors only")
    names = {dtype: name for name, dtype in _torch_dtypes().items()}
    if tensor.dtype not in names:
        raise ValueError(f"unsupported torch dtype {tensor.dtype}")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return RawTensor(names[tensor.dtype], tuple(tensor.shape), flat.numpy())


def _raw_from_numpy(array: np.ndarray) -> RawTensor:
    name = _NUMPY_NAMES.get(array.dtype.name)
    if name is None:
        raise ValueError(f"unsupported numpy dtype {array.dtype}")
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return RawTensor(name, tuple(array.shape), flat)


def raw_state(state: State) -> dict[str, RawTensor]:
    """View every tensor of a state as a RawTensor, keeping the order."""
    return {name: as_raw(tensor) for name, tensor in state.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    check_dtype(name)
    return _torch_dtypes()[name]


def to_torch(raw: RawTensor) -> torch.Tensor:
    """A torch tensor sharing the RawTensor's bytes when they are writable, else a copy."""
    import torch

    dtype = _torch_dtypes()[raw.dtype]
    if raw.data.size == 0:
        return torch.empty(raw.shape, dtype=dtype)
    data = raw.data if raw.data.flags.writeable else raw.data.copy()
    return torch.from_numpy(data).view(dtype).reshape(raw.shape)


def to_numpy(raw: RawTensor) -> np.ndarray:
    """A numpy array viewing the RawTensor's bytes; bf16 and fp8 need a torch or raw output."""
    name = _NUMPY_BY_NAME.get(raw.dtype)
    try:
        dtype = np.dtype(name) if name else None
    except TypeError:
        dtype = None
    if dtype is None:
        raise ValueError(f"numpy cannot hold {raw.dtype}; ask for torch or raw output instead")
    return raw.data.view(dtype).reshape(raw.shape)


def empty_raw(dtype: str, shape: tuple[int, ...]) -> RawTensor:
    """A new zero-filled RawTensor."""
    numel = int(np.prod(shape, dtype=np.int64))
    return RawTensor(dtype, shape, np.zeros(numel * check_dtype(dtype), dtype=np.uint8))


def like_kind(raw: RawTensor, kind: str) -> TensorLike:
    """Convert a RawTensor to the output kind: 'torch', 'numpy' or 'raw'."""
    if kind == "torch":
        return to_torch(raw)
    if kind == "numpy":
        return to_numpy(raw)
    if kind == "raw":
        return raw
    raise ValueError(f"unknown output kind {kind!r}; use 'torch', 'numpy' or 'raw'")


def kind_of(tensor: TensorLike) -> str:
    """The output kind matching a tensor: 'torch', 'numpy' or 'raw'."""
    if _is_torch(tensor):
        return "torch"
    if isinstance(tensor, np.ndarray):
        return "numpy"
    return "raw"
