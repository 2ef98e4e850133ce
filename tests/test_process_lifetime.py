"""A process asked to die with its parent (libs/process_lifetime.py) does, however the parent
dies; one whose parent was gone before it asked exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
REPO_ROOT = Path(__file__).resolve().parent.parent

# A parent that starts `sleep` as a child dying with it (as the launcher starts a service),
# prints the child's pid, then waits to be killed.
PARENT = """
import functools, os, signal, subprocess, sys, time
from libs.process_lifetime import die_with_parent
child = subprocess.Popen(["sleep", "600"], preexec_fn=functools.partial(
    die_with_parent, signal.SIGTERM, os.getpid()))
print(child.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_child_dies_when_its_parent_is_killed_outright() -> None:
    parent = subprocess.Popen([PY, "-c", PARENT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    try:
        assert running(child_pid)
        parent.kill()  # SIGKILL: the parent runs no cleanup of its own
        parent.wait()
        deadline = time.monotonic() + 60
        while running(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child_pid), "the child outlived its parent"
    finally:
        if running(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_process_whose_parent_is_already_gone_exits_at_once() -> None:
    code = (
        "import signal, sys\n"
        "from libs.process_lifetime import die_with_parent\n"
        "die_with_parent(signal.SIGKILL, int(sys.argv[1]))\n"
        "print('still here')\n"
    )
    ours = subprocess.run(
        [PY, "-c", code, str(os.getpid())], cwd=REPO_ROOT, capture_output=True, text=True
    )
    # A parent pid that is not this process's parent: as if the parent had died and the
    # process had been handed to another before it asked.
    orphan = subprocess.run([PY, "-c", code, "1"], cwd=REPO_ROOT, capture_output=True, text=True)

    assert ours.returncode == 0 and ours.stdout == "still here\n"
    assert orphan.returncode == 1 and orphan.stdout == ""


def test_the_kernel_holds_the_signal_asked_for() -> None:
    code = (
        "import ctypes, os, signal\n"
        "from libs.process_lifetime import die_with_parent\n"
        "die_with_parent(signal.SIGTERM, os.getppid())\n"
        "got = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG\n"
        "print(got.value)\n"
    )
    out = subprocess.run([PY, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == signal.SIGTERM
