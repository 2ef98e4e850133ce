"""Which CUDA card a call works on: the tensors' card, never the thread's current device.

CUDA keeps a current device per host thread (card 0 unless set, in every new thread).
Torch's tensor ops follow their tensors, but a Triton kernel launches, `torch.cuda.Stream()`
creates its stream, an event records and a CUDA graph captures on the current device. A
rollout-worker on card 1 crashed in a Triton kernel ("Pointer argument (at 0) cannot be
accessed from Triton (cpu tensor?)"), so such calls go through these:

    with on_device_of(hidden):            # Triton launches, graph captures
        kernel[grid](hidden, ...)
    event = recorded_event(device)        # after the work queued on that card's stream
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch


def on_device_of(tensor: torch.Tensor | torch.device) -> contextlib.AbstractContextManager[Any]:
    """The CUDA card of `tensor` (or a device) current in this thread inside; nothing on CPU."""
    device = tensor if isinstance(tensor, torch.device) else tensor.device
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def cuda_device_of(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The card of the first CUDA tensor of `tensors`; None when none is on a card."""
    return next((tensor.device for tensor in tensors if tensor.is_cuda), None)


def recorded_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded after everything queued so far on `device`'s current stream (the
    calling thread's), whichever card is current."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
