"""Which tensors a weight version is written into, for the weights follower
(libs/rollout/weights_follower.py): the engine's own live tensors where they can be written
in place, else a CPU shadow copy whose changed tensors go to the engine afterwards.

    if writable_on_host(engine.live_tensors()): host = engine.live_tensors()
    state = state_for(update, host, shadow)       # what the receiver writes `update` into
    changed = changed_tensors(update, state)      # what a shadow then hands to the engine
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import structlog
import torch

from libs.weights.errors import WeightsError
from libs.weights.receiver import PreparedUpdate

log = structlog.get_logger(__name__)


class WeightsMismatchError(WeightsError):
    """A version names tensors the engine's model does not have."""


def writable_on_host(tensors: dict[str, torch.Tensor] | None) -> bool:
    """True when the receiver can write these tensors in place: contiguous, on the CPU
    (numpy views) or on a CUDA device (libs.weights.gpu_apply scatters there); a non-contiguous
    tensor's view would be a copy."""
    if not tensors:
        return False
    return all(t.device.type in ("cpu", "cuda") and t.is_contiguous() for t in tensors.values())


def state_for(
    update: PreparedUpdate, host: dict[str, torch.Tensor] | None, state: dict[str, Any]
) -> dict[str, Any]:
    """The mapping `update` is written into: the `host` tensors it names (in place), or the
    shadow `state`; a snapshot re-picks the tensors, a delta writes what the last one did."""
    names = [entry.name for entry in update.announcement.manifest.tensors]
    if host is not None:
        unknown = [name for name in names if name not in host]
        if unknown:
            raise WeightsMismatchError(
                f"version {update.version} names {len(unknown)} tensor(s) the model lacks, "
                f"first {unknown[:3]}: is the worker's policy the trainer's architecture?"
            )
        if update.kind == "snapshot":
            warn_uncovered(host, set(names))
            return {name: host[name] for name in names}
        return state
    if update.kind == "snapshot":
        return {name: state[name] for name in names if name in state}
    return state


def warn_uncovered(host: dict[str, torch.Tensor], names: set[str]) -> None:
    """Log model tensors a version does not write and that share no storage with one it
    does (tied weights do): they would keep the worker's own initial values."""
    covered = {host[name].data_ptr() for name in names}
    stale = [n for n, t in host.items() if n not in names and t.data_ptr() not in covered]
    if stale:
        log.warning("weight version leaves model tensors unwritten", tensors=stale[:5])


def changed_tensors(update: PreparedUpdate, state: MutableMapping[str, Any]) -> dict[str, Any]:
    """The tensors of `state` that `update` wrote (all of them for a snapshot)."""
    entries = update.announcement.manifest.tensors
    if update.kind == "snapshot":
        return {entry.name: state[entry.name] for entry in entries}
    return {entry.name: state[entry.name] for entry in entries if entry.change != "same"}
