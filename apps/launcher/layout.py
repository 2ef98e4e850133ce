"""Where a run's processes go: each instance's name, and each rollout-worker's device.

A layout puts the trainer's ranks on the first cards (`--trainer-ranks N`: cuda:0 .. N-1,
torchrun's local ranks) and one rollout-worker on each of `--worker-devices` (e.g.
cuda:2,cuda:3): every worker sees every card, so a version can still go card to card.
"""

from __future__ import annotations

from collections.abc import Sequence

WORKER = "rollout-worker"


def instance_name(service: str, index: int) -> str:
    """The first instance keeps the service's name (logs, health, summaries read it);
    the others are numbered from 2."""
    return service if index == 0 else f"{service}-{index + 1}"


def worker_device(service: str, instance: str, devices: Sequence[str]) -> dict[str, str]:
    """The environment that puts rollout-worker `instance` on its device of the layout (over
    the recipe's policy.device); nothing for other services or without a layout."""
    if service != WORKER or not devices:
        return {}
    names = [instance_name(service, i) for i in range(len(devices))]
    return {"RLPIPE_ROLLOUT_WORKER_POLICY_DEVICE": devices[names.index(instance)]}
