"""Where decoded pieces are written: an element range of a tensor, behind a tiny interface.

The codec reads old values and writes new ones only through `ElementRange`, so applying a
delta touches only the changed elements. `CpuRange` serves numpy arrays and CPU torch
tensors (they share memory). `gpu_apply.GpuRange` implements the same methods with torch indexing
on the device (gather to host, scatter of values staged on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ElementRange(Protocol):
    """Elements [start, stop) of one tensor, as little-endian unsigned ints of `width` bytes."""

    @property
    def width(self) -> int:
        """Element width in bytes."""
        ...

    @property
    def size(self) -> int:
        """Number of elements in the range."""
        ...

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Current values at range-relative positions (a host array)."""
        ...

    def read_all(self) -> np.ndarray:
        """Current values of the whole range (a host array)."""
        ...

    def scatter(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Write values at range-relative positions."""
        ...

    def write_all(self, values: np.ndarray) -> None:
        """Overwrite the whole range."""
        ...


@dataclass(frozen=True)
class CpuRange:
    """An ElementRange over a host array of unsigned elements (a view: writes land in place)."""

    units: np.ndarray

    @property
    def width(self) -> int:
        """Element width in bytes."""
        return int(self.units.dtype.itemsize)

    @property
    def size(self) -> int:
        """Number of elements in the range."""
        return int(self.units.size)

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Current values at range-relative positions."""
        return self.units[positions]

    def read_all(self) -> np.ndarray:
        """Current values of the whole range (a view)."""
        return self.units

    def scatter(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Write values at range-relative positions."""
        self.units[positions] = values

    def write_all(self, values: np.ndarray) -> None:
        """Overwrite the whole range."""
        self.units[:] = values
