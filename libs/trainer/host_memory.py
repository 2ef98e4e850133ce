"""Host memory the trainer copies its tensors into, reused from one copy to the next."""

from __future__ import annotations

import torch


class HostCopy:
    """Host buffers for copies of the trainer's tensors, kept from one copy to the next (the
    checkpoints written in the background, the weights handed to the stager): the first copy
    allocates (and faults in) them, about as slow as writing them out; later ones copy into
    them at memory speed. A copy's
    buffers are overwritten by the next: use one before taking another."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into the buffer of `key` (blocking)."""
        return self.buffer(key, tensor).copy_(tensor.detach())

    def buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer of `key`, shaped and typed as `like` (made anew when it is not)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self._buffers[key] = self._allocate(like)
        return buffer

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        pin = like.is_cuda  # pinned: the copy from the GPU runs at full bus speed
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
