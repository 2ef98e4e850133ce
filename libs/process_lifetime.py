"""A process that dies with its parent: the Linux parent-death signal, asked for in one place.

    die_with_parent(signal.SIGKILL, parent_pid)        # first thing in a spawned child
    subprocess.Popen(argv, preexec_fn=functools.partial(
        die_with_parent, signal.SIGTERM, os.getpid()))  # in the child, before exec

However the parent dies (a SIGKILL, an OOM kill), the kernel sends `signum` to the child, so
no helper, service or trainer rank outlives what started it. Used by the services' helper
processes (libs/child_process.py), the trainer's ranks under torchrun, the demo launcher's
services and the Ray actors' services.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(signum: signal.Signals, parent_pid: int | None = None) -> None:
    """Ask the kernel for `signum` when this process's parent dies. A parent that died
    before the request took hold is caught too: this process is then no longer the child
    of `parent_pid` (or, without one, has been handed to init), and it exits at once."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    orphaned = os.getppid() != parent_pid if parent_pid is not None else os.getppid() == 1
    if orphaned:
        os._exit(1)
