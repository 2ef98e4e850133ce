"""The handoff of new weights from the trainer to the weight-broadcaster.

They run side by side in the training cluster and share a staging folder (the same disk,
or one volume mounted in both). For each new version the trainer calls

    await stage_weights(publisher, staging_dir, state_dict, version)

which writes `<staging_dir>/v<version>.safetensors` (to a temporary name, fsynced, then an
atomic rename, fsynced: libs.durable_files, so the broadcaster never sees half a file, not
even after the machine crashed) and then publishes a `WeightsStaged`
message (version, file name, size) to `rl.weights.staged` (stream RL_WEIGHTS_STAGED, a work
queue, msg id `staged.<version>` so a retried publish is not a second version). The
broadcaster consumes it durably (consumer `weight-broadcaster`, one at a time, in order),
acks only once the version is stored and announced, and owns the file from then on: it
keeps the latest version's file (the base of the next delta, and its fast restart path) and
deletes older ones. Versions must increase; a version at or below the last one announced is
ignored when its bytes are the same and refused when they differ.

Where the trainer encodes deltas itself (its weights on a GPU: libs/trainer/staging.py),
it hands over the first version whole and each later one as a delta against the version it
handed over before:

    write_staged_delta(staging_dir, manifest, chunks)   # in the trainer's encoder process
    await announce_staged_delta(publisher, staging_dir, version, base_version)

writes `<staging_dir>/v<version>.delta` (libs/weights/container.py) and publishes a
`WeightsStaged` of kind "delta" naming its base. The broadcaster stores that delta as it
is: no 1 GB file written, read back and diffed again for a few changed values, and reads
it memory-mapped, publishing each chunk's record as it lies in the file.

Where the two share a host (every deployment the launcher makes), the delta goes through
shared memory instead of the disk: the broadcaster offers a folder in /dev/shm (a file
`shm-offer` in the staging folder names it and a random token it holds there), and the
trainer's side writes a delta there, linked from the staging folder, when it sees the same
token in the same place (so the same /dev/shm: not a container of its own, not another
host) and /dev/shm has room. Elsewhere, and for the first delta before the offer, the file
is on the staging disk as before. Through the disk byte-3b's lr 1e-5 delta (560 MB) took
1.3 s on an H200 host to write and read back (bench/weights_delta_path_bench.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from libs.bus.publisher import Publisher
from libs.durable_files import publish_durably
from libs.weights.container import EncodedChunks, map_delta_file, write_delta_file
from libs.weights.errors import CorruptDeltaError
from libs.weights.format import Chunk, Manifest
from libs.weights.hashing import digest
from libs.weights.safetensors_io import read_safetensors, write_safetensors
from libs.weights.tensors import RawTensor, raw_state
from proto.messages import StagedKind, WeightsStaged
from proto.subjects import WEIGHTS_STAGED

log = structlog.get_logger(__name__)

_FILE_RE = re.compile(r"^v(\d+)\.(safetensors|delta)$")
_SUFFIXES: dict[StagedKind, str] = {"state": "safetensors", "delta": "delta"}
SHM_PATH = Path("/dev/shm")
SHM_OFFER = "shm-offer"  # in the staging folder: the broadcaster's folder in /dev/shm
SHM_SPARE_BYTES = 256 << 20  # left free in /dev/shm beside a delta written there


def default_staging_dir(run_dir: Path) -> Path:
    """Where trainer and broadcaster meet unless configured: `<run_dir>/weights-staging`."""
    return run_dir / "weights-staging"


def staged_file_name(version: int, kind: StagedKind = "state") -> str:
    """File name of a staged version, e.g. `v12.safetensors` (a delta: `v12.delta`)."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version}.{_SUFFIXES[kind]}"


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
    path = _staged_path(staging_dir, version, "state")
    started_s = time.monotonic()
    # The copy to the host blocks until the device is done: off the event loop with the write.
    await asyncio.to_thread(_write_state, path, state)
    message = WeightsStaged(
        version=version, file_name=path.name, num_bytes=path.stat().st_size, step=step,
        created_at=time.time(),
    )  # fmt: skip
    return await _hand_over(publisher, message, started_s, offered_s)


def write_staged_delta(staging_dir: str | Path, manifest: Manifest, chunks: list[Chunk]) -> Path:
    """Write a delta file for `announce_staged_delta` (blocking): into the broadcaster's
    folder in /dev/shm, linked from the staging folder, where it offers one this side sees
    and it fits (see the module docstring), else into the staging folder."""
    if manifest.base_version is None:
        raise ValueError(f"version {manifest.version} is a snapshot, not a delta: stage it whole")
    path = _staged_path(staging_dir, manifest.version, "delta")
    size = sum(ref.num_bytes for ref in manifest.chunks) + len(manifest.chunks) * 8 + (1 << 20)
    shared = _offered_shm(path.parent, size)
    if shared is None:
        write_delta_file(path, manifest, chunks)
        return path
    write_delta_file(shared / path.name, manifest, chunks)
    link = path.with_name(path.name + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(shared / path.name)
    publish_durably(link, path)  # atomic: the broadcaster never sees a half-made name
    return path


def offer_shm(staging_dir: str | Path) -> Path | None:
    """The broadcaster's side: make (once) a folder in /dev/shm for staged deltas and name it,
    with a token kept there, in the staging folder; returns it (None: none could be made,
    and deltas keep coming through the staging folder)."""
    directory = Path(staging_dir)
    folder = SHM_PATH / f"rlpipe-staging-{digest(str(directory.resolve()).encode()).hex()[:16]}"
    offer = directory / SHM_OFFER
    if _read_offer(offer) == folder and _read_offer(offer, folder) is not None:
        return folder
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        token = secrets.token_hex(16)
        (folder / SHM_OFFER).write_text(token)
        partial = offer.with_name(SHM_OFFER + ".partial")
        partial.write_text(json.dumps({"folder": str(folder), "token": token}))
        partial.replace(offer)
    except OSError as exc:
        log.warning(
            "no shared memory for staged deltas: they come through the disk", error=str(exc)
        )
        return None
    return folder


def release_shm(staging_dir: str | Path) -> None:
    """The broadcaster's side, stopping: withdraw the offer and empty its /dev/shm folder (a
    tmpfs keeps what nobody deletes until the host reboots). A delta still waiting there is
    moved into the staging folder first (its link replaced by the file), so a broadcaster
    started again on this folder still finds it."""
    directory = Path(staging_dir)
    folder = _read_offer(directory / SHM_OFFER)
    if folder is None:
        return
    (folder / SHM_OFFER).unlink(missing_ok=True)  # the trainer's side writes here no more
    (directory / SHM_OFFER).unlink(missing_ok=True)
    for path in directory.glob("v*.delta"):
        if path.is_symlink() and path.readlink().parent == folder and path.exists():
            partial = path.with_name(path.name + ".partial")
            shutil.copyfile(path, partial)
            publish_durably(partial, path)
    shutil.rmtree(folder, ignore_errors=True)


def _read_offer(offer: Path, folder: Path | None = None) -> Path | None:
    """The offered folder (with `folder`: whether its token there matches the offer's)."""
    try:
        named = json.loads(offer.read_text())
        found = Path(named["folder"])
        if folder is not None:
            return found if (found / SHM_OFFER).read_text() == named["token"] else None
        return found
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _offered_shm(staging_dir: Path, size: int) -> Path | None:
    """The broadcaster's /dev/shm folder if this side shares it and it has room for `size`."""
    folder = _read_offer(staging_dir / SHM_OFFER)
    if folder is None or _read_offer(staging_dir / SHM_OFFER, folder) is None:
        return None
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return folder if stats.f_bavail * stats.f_frsize >= size + SHM_SPARE_BYTES else None


async def announce_staged_delta(
    publisher: Publisher,
    staging_dir: str | Path,
    version: int,
    base_version: int | None,
    *,
    step: int | None = None,
    offered_s: float | None = None,
    encode_s: float = 0.0,
    diff_s: float = 0.0,
) -> WeightsStaged:
    """Tell the broadcaster about a delta file written by `write_staged_delta`. `encode_s`
    is the time the encode and write took, `diff_s` the part of it spent finding the
    changes, for the version's latency (they happened before this call)."""
    path = Path(staging_dir) / staged_file_name(version, "delta")
    message = WeightsStaged(
        version=version, file_name=path.name, num_bytes=path.stat().st_size, step=step,
        created_at=time.time(), kind="delta", base_version=base_version,
    )  # fmt: skip
    started_s = time.monotonic() - encode_s
    return await _hand_over(
        publisher, message, started_s, offered_s, encode_s=encode_s, diff_s=diff_s
    )


def _staged_path(staging_dir: str | Path, version: int, kind: StagedKind) -> Path:
    directory = Path(staging_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / staged_file_name(version, kind)


async def _hand_over(
    publisher: Publisher,
    message: WeightsStaged,
    started_s: float,
    offered_s: float | None,
    encode_s: float = 0.0,
    diff_s: float = 0.0,
) -> WeightsStaged:
    """Publish the staged version's message and log the handover."""
    await publisher.publish(WEIGHTS_STAGED, message, msg_id=f"staged.{message.version}")
    # The first part of a version's latency (bench/version_latency.py reads this line:
    # stage_s includes encode_s, the trainer's own encode of a delta, and that diff_s).
    stage_s = time.monotonic() - started_s
    waited_s = round(started_s - offered_s, 4) if offered_s is not None else 0.0
    log.info(
        "weights staged", version=message.version, kind=message.kind,
        mb=round(message.num_bytes / 1e6, 2), stage_s=round(stage_s, 4),
        encode_s=round(encode_s, 4), diff_s=round(diff_s, 4), waited_s=waited_s,
    )  # fmt: skip
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
    return read_safetensors(_checked_path(staging_dir, message, "state"))


def load_staged_delta(
    staging_dir: str | Path, message: WeightsStaged
) -> tuple[Manifest, EncodedChunks]:
    """The staged delta's manifest and chunks (memory-mapped records, container.py); ValueError
    naming the problem when the file is missing, truncated, damaged, or not the version and
    base the message names. Offers /dev/shm for the next ones (`offer_shm`)."""
    offer_shm(staging_dir)
    path = _checked_path(staging_dir, message, "delta")
    try:
        manifest, chunks = map_delta_file(path)
    except CorruptDeltaError as exc:
        raise ValueError(f"staged delta {path}: {exc}") from exc
    if (manifest.version, manifest.base_version) != (message.version, message.base_version):
        raise ValueError(
            f"staged delta {path} holds version {manifest.version} on "
            f"{manifest.base_version}; the trainer announced {message.version} on "
            f"{message.base_version}"
        )
    return manifest, chunks


def _checked_path(staging_dir: str | Path, message: WeightsStaged, kind: StagedKind) -> Path:
    """The staged file's path, checked against the message (name, kind, size)."""
    expected = staged_file_name(message.version, kind)
    if message.kind != kind or message.file_name != expected:
        raise ValueError(
            f"staged file name {message.file_name!r} (kind {message.kind}) is not {expected}"
        )
    path = Path(staging_dir) / message.file_name
    if not path.is_file():
        where = f" (it links to {path.readlink()}: not on this host?)" if path.is_symlink() else ""
        raise ValueError(
            f"staged file {path} does not exist{where} (is the staging folder shared?)"
        )
    size = path.stat().st_size
    if size != message.num_bytes:
        raise ValueError(
            f"staged file {path} is {size} bytes, the trainer wrote {message.num_bytes}"
        )
    return path


def staged_versions(staging_dir: str | Path, kind: StagedKind | None = None) -> list[int]:
    """Versions with a staged file (of `kind`, or either), ascending."""
    directory = Path(staging_dir)
    if not directory.is_dir():
        return []
    suffixes = set(_SUFFIXES.values()) if kind is None else {_SUFFIXES[kind]}
    found = (_FILE_RE.match(p.name) for p in directory.iterdir())
    return sorted({int(m.group(1)) for m in found if m and m.group(2) in suffixes})


def remove_staged_before(staging_dir: str | Path, version: int) -> list[int]:
    """Delete staged files of versions below `version`; returns the versions deleted."""
    removed = [v for v in staged_versions(staging_dir) if v < version]
    for old in removed:
        for kind in _SUFFIXES:
            path = Path(staging_dir) / staged_file_name(old, kind)
            if path.is_symlink():  # a delta in /dev/shm: its bytes go with the name
                path.readlink().unlink(missing_ok=True)
            path.unlink(missing_ok=True)
    return removed
