"""Which stream each trainer step trains on: offline (scored rollouts) or online (feedback).

A step schedule, set by `online_fraction` (0: offline only, 1: online only): step s
(0-based) is scheduled online when floor((s + 1) * f) > floor(s * f), so over any n steps
round(n * f) of them (to within one) are online steps, spread evenly: f = 0.25 makes steps
3, 7, 11, ... online. A step trains on one stream only: offline steps are whole GRPO batches
with group advantages, online steps up to `online_batch_samples` single samples with
baseline advantages, each with its own objective.

No stall: a step waits up to `stream_wait_s` for its scheduled stream (offline: a complete
group; online: a full online batch); after that it takes whichever stream has something
(online: at least one fresh sample), its scheduled one first. With f = 0 or f = 1 there is
no other stream, and the step waits for its own as long as it takes.
"""

from __future__ import annotations

from typing import Literal

Stream = Literal["offline", "online"]

_FRACTION_SCALE = 1_000_000  # integer arithmetic: 0.1 * 10 steps is exactly one


def scheduled_stream(step: int, online_fraction: float) -> Stream:
    """The stream step `step` (0-based) is scheduled to train on."""
    if not 0.0 <= online_fraction <= 1.0:
        raise ValueError(f"online_fraction must be in [0, 1], got {online_fraction}")
    scaled = round(online_fraction * _FRACTION_SCALE)
    rises = (step + 1) * scaled // _FRACTION_SCALE > step * scaled // _FRACTION_SCALE
    return "online" if rises else "offline"


def choose_stream(
    scheduled: Stream,
    *,
    offline_ready: bool,
    online_fresh: int,
    online_batch_samples: int,
    online_fraction: float,
    waited_s: float,
    stream_wait_s: float,
) -> Stream | None:
    """The stream to train on now, or None to keep waiting (the rule in the module doc)."""
    timed_out = waited_s >= stream_wait_s
    online_ready = online_fresh >= online_batch_samples or (timed_out and online_fresh > 0)
    if online_fraction >= 1.0:
        return "online" if online_ready else None
    if online_fraction <= 0.0:
        return "offline" if offline_ready else None
    if scheduled == "online" and online_ready:
        return "online"
    if offline_ready and (scheduled == "offline" or timed_out):
        return "offline"
    if timed_out and online_fresh > 0:
        return "online"
    return None
