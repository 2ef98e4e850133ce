"""Staged weights and checkpoints are complete on disk once they are announced.

A real writer (tests/durability_support.py: the trainer's own staging and Checkpointer) is
killed with SIGKILL right after it announces a staged version (its `WeightsStaged` on a real
nats-server) or a checkpoint (its "checkpoint saved" line); what it announced then loads and
verifies. A killed process loses nothing the kernel holds, so the same writers also run
under strace: every file and folder is fsynced before the rename that publishes it, and the
folder holding the new name after it, all before the announcement, which is what keeps them
through an OS crash or a power loss (libs.durable_files).

Run: .venv/bin/python -m pytest tests/test_durability.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import torch

from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import ensure_stream
from libs.nats_server import NatsServer
from libs.tokenizer import ByteTokenizer
from libs.trainer.checkpoint import STATE_FILE, TrainerState
from libs.trainer.checkpointer import Checkpointer
from libs.weights import handoff
from libs.weights.applier import decode
from libs.weights.handoff import load_staged, load_staged_delta
from libs.weights.hashing import state_hash
from libs.weights.tensors import raw_state
from proto import streams, subjects
from proto.messages import WeightsStaged
from tests.durability_support import checkpoint_learner, weights, weights_hash

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0  # for a writer's announcement: a deadline against a hang, not a speed bound


@contextmanager
def writer(*args: str, prefix: tuple[str, ...] = ()) -> Iterator[subprocess.Popen[str]]:
    """A durability_support writer; killed (by pid) and reaped whatever the test does."""
    command = [*prefix, sys.executable, "-m", "tests.durability_support", *args]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        if process.stdout is not None and not process.stdout.closed:
            process.communicate()
        process.wait()


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm: loading a staged delta offers it for the next ones."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(handoff, "SHM_PATH", folder)
    return folder


@pytest.mark.usefixtures("shm")
async def test_a_staged_version_is_complete_on_disk_when_its_writer_is_killed_right_after(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    await ensure_stream(bus.js, streams.WEIGHTS_STAGED)
    announcements = await bus.nc.subscribe(subjects.WEIGHTS_STAGED)
    staged: list[WeightsStaged] = []
    with writer("stage", str(staging), nats_server.url) as process:
        while not staged or staged[-1].version < 2:
            msg = await announcements.next_msg(timeout=WAIT_S)
            staged.append(wire.decode(WeightsStaged, msg.data, msg.headers))
        os.kill(process.pid, signal.SIGKILL)  # right after the first delta's announcement

    whole, delta = staged
    assert (whole.kind, delta.kind, delta.base_version) == ("state", "delta", 1)
    assert state_hash(load_staged(staging, whole)) == state_hash(raw_state(weights(1)))
    manifest, chunks = load_staged_delta(staging, delta)  # every record's hash checked
    second = decode(weights(1), manifest, chunks, verify_full=True)
    assert torch.equal(second["w"].view(torch.int16), weights(2)["w"].view(torch.int16))


def test_a_checkpoint_is_complete_on_disk_when_its_trainer_is_killed_right_after(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "checkpoints"
    hashes: dict[int, str] = {}
    with writer("checkpoint", str(folder)) as process:
        assert process.stdout is not None
        for line in process.stdout:
            record = json.loads(line) if line.startswith("{") else {}
            if "weights_hash" in record:
                hashes[record["step"]] = record["weights_hash"]
            if record.get("event") == "checkpoint saved":
                os.kill(process.pid, signal.SIGKILL)
                saved = Path(record["path"])
                break
        else:
            pytest.fail(f"the trainer exited (rc {process.wait()}) without saving a checkpoint")

    state = msgspec.json.decode((saved / STATE_FILE).read_bytes(), type=TrainerState)
    learner, config = checkpoint_learner()
    learner.load(saved)  # the trainer's resume: weights and AdamW state
    assert weights_hash(learner.model) == hashes[state.step]
    assert learner.optimizer.state, "AdamW's moments came back"
    resumed = Checkpointer(folder, learner, ByteTokenizer(), config).resume()
    assert resumed is not None and resumed.step >= state.step


# --- the order of the syscalls, under strace -----------------------------------------------


def traced(tmp_path: Path) -> tuple[str, ...]:
    """strace's command line, tracing fsyncs, renames and writes with their paths."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    if subprocess.run(["strace", "-f", "-o", os.devnull, "true"], check=False).returncode:
        pytest.skip("strace cannot trace here (ptrace not permitted)")
    calls = "fsync,rename,renameat,renameat2,write,sendto,sendmsg"
    return ("strace", "-f", "-qq", "-y", "-s", "1024", "-e", f"trace={calls}",
            "-o", str(tmp_path / "trace.txt"))  # fmt: skip


def first(lines: list[str], pattern: str, after: int = -1) -> int:
    """Index of the first line after `after` matching `pattern`."""
    for index in range(after + 1, len(lines)):
        if re.search(pattern, lines[index]):
            return index
    raise AssertionError(f"no syscall matching {pattern!r} after line {after}")


def published_durably(lines: list[str], files: list[Path], partial: Path, final: Path) -> int:
    """Check: each of `files` fsynced, then `partial` renamed to `final`, then the folder
    holding it fsynced; returns the index of that last fsync."""
    synced = [first(lines, rf"fsync\(\d+<{re.escape(str(f))}>\)") for f in files]
    renamed = first(lines, rf'rename.*"{re.escape(str(partial))}", .*"{re.escape(str(final))}"')
    assert max(synced) < renamed, f"{partial} renamed before its data was on disk"
    return first(lines, rf"fsync\(\d+<{re.escape(str(final.parent))}>\)", after=renamed)


async def test_a_staged_version_reaches_the_disk_before_its_name_and_its_name_before_the_bus(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    await ensure_stream(bus.js, streams.WEIGHTS_STAGED)
    with writer("stage", str(staging), nats_server.url, "2", prefix=traced(tmp_path)) as process:
        output, _ = process.communicate()
        assert process.returncode == 0, output
    lines = (tmp_path / "trace.txt").read_text().splitlines()
    for version, name in ((1, "v1.safetensors"), (2, "v2.delta")):
        partial, final = staging / f"{name}.partial", staging / name
        synced = published_durably(lines, [partial], partial, final)
        sent = rf"(sendto|write|sendmsg)\(\d+<socket.*rl\.weights\.staged.*staged\.{version}\b"
        announced = first(lines, sent)
        assert announced > synced, f"{name} was announced before its rename was on disk"


def test_a_checkpoint_reaches_the_disk_before_its_name_and_its_name_before_the_log(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "checkpoints"
    with writer("checkpoint", str(folder), "1", prefix=traced(tmp_path)) as process:
        output, _ = process.communicate()
        assert process.returncode == 0, output
    lines = (tmp_path / "trace.txt").read_text().splitlines()
    partial, final = folder / ".step-00000001.partial", folder / "step-00000001"
    files = [partial / name for name in ("model.safetensors", "optimizer.pt", STATE_FILE)]
    synced = published_durably(lines, [*files, partial], partial, final)
    first(lines, r"write\(2<.*checkpoint saved", after=synced)
