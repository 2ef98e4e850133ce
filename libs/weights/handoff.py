"""The handoff of new weights from the trainer to the weight-broadcaster.

They run side by side in the training cluster and share a staging folder (the same disk,
or one volume mounted in both). For each new version the trainer calls

    await stage_weights(publisher, staging_dir, state_dict, version)

which writes `<staging_dir>/v<version>.safetensors` (to a temporary name, then an atomic
rename, so the broadcaster never sees half a file) and then publishes a `WeightsStaged`
message (version, file name, size) to `rl.weights.staged` (stream RL_WEIGHTS_STAGED, a work
queue, msg id `staged.<version>` so a retried publish is not a second version). The
broadcaster consumes it durably (consumer `weight-broadcaster`, one at a time, in order),
acks only once the version is stored and announced, and owns the file from then on: it
keeps the latest version's file (the base of the next delta, and its fast restart path) and
deletes older ones. Versions must increase; a version at or below the last one announced is
ignored when its bytes are the same and refused when they differ.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from libs.bus.publisher import Publisher
from libs.weights.safetensors_io import read_safetensors, write_safetensors
from libs.weights.tensors import RawTensor, raw_state
from proto.messages import WeightsStaged
from proto.subjects import WEIGHTS_STAGED

log = structlog.get_logger(__name__)

_FILE_RE = re.compile(r"^v(\d+)\.safetensors$")


def default_staging_dir(run_dir: Path) -> Path:
    """Where trainer and broadcaster meet unless configured: `<run_dir>/weights-staging`."""
    return run_dir / "weights-staging"


def staged_file_name(version: int) -> str:
    """File name of a staged version, e.g. `v12.safetensors`."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version}.safetensors"


async def stage_weights(
    publisher: Publisher,
    staging_dir: str | Path,
    state: Mapping[str, Any],
    version: int,
    *,
    step: int | None = None,
    offered_s: float | None = None,
) -> WeightsStaged:
    """Write `state` (numpy arrays or torch tensors, any device) as version `version` and
    tell the broadcaster; returns once the message is stored on the bus. `offered_s`
    (time.monotonic) is when the trainer handed the version over, if it waited since."""
    directory = Path(staging_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / staged_file_name(version)
    started_s = time.monotonic()
    # The copy to the host blocks until the device is done: off the event loop with the write.
    await asyncio.to_thread(_write_state, path, state)
    stage_s = time.monotonic() - started_s
    message = WeightsStaged(
        version=version,
        file_name=path.name,
        num_bytes=path.stat().st_size,
        step=step,
        created_at=time.time(),
    )
    await publisher.publish(WEIGHTS_STAGED, message, msg_id=f"staged.{version}")
    # The first part of a version's latency (bench/version_latency.py reads this line).
    mb = round(message.num_bytes / 1e6, 2)
    waited_s = round(started_s - offered_s, 4) if offered_s is not None else 0.0
    log.info("weights staged", version=version, mb=mb, stage_s=round(stage_s, 4), waited_s=waited_s)
    return message


def _write_state(path: Path, state: Mapping[str, Any]) -> None:
    write_safetensors(path, raw_state(_on_cpu(state)))


def _on_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state with torch tensors moved to the CPU (the codec reads host memory)."""
    out = {}
    for name, tensor in state.items():
        device = getattr(tensor, "device", None)
        out[name] = tensor.detach().cpu() if device is not None and device.type != "cpu" else tensor
    return out


def load_staged(staging_dir: str | Path, message: WeightsStaged) -> dict[str, RawTensor]:
    """The staged state (memory-mapped, read-only); ValueError naming the problem when the
    file is missing, truncated or not safetensors."""
    if _FILE_RE.match(message.file_name) is None:
        raise ValueError(f"staged file name {message.file_name!r} is not v<version>.safetensors")
    path = Path(staging_dir) / message.file_name
    if not path.is_file():
        raise ValueError(f"staged file {path} does not exist (is the staging folder shared?)")
    size = path.stat().st_size
    if size != message.num_bytes:
        raise ValueError(
            f"staged file {path} is {size} bytes, the trainer wrote {message.num_bytes}"
        )
    return read_safetensors(path)


def staged_versions(staging_dir: str | Path) -> list[int]:
    """Versions with a staged file, ascending."""
    directory = Path(staging_dir)
    if not directory.is_dir():
        return []
    found = (_FILE_RE.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def remove_staged_before(staging_dir: str | Path, version: int) -> list[int]:
    """Delete staged files of versions below `version`; returns the versions deleted."""
    removed = [v for v in staged_versions(staging_dir) if v < version]
    for old in removed:
        (Path(staging_dir) / staged_file_name(old)).unlink(missing_ok=True)
    return removed
