"""A helper process of a service's own: spawned, fed requests on one queue, answering on
another, and killed with its parent.

The trainer's delta encoder (libs/trainer/delta_encoder.py) and the rollout worker's weight
decoder (libs/weights/decode_process.py) run their CPU work in such a process so that it
holds no GIL the service's own threads need. The child function receives the two queues
and its arguments, calls `become_child(parent_pid)` first, and answers each request with
`(status, value, detail)` until it reads None:

    child = ChildProcess(serve, (options,), name="rlpipe-delta-encoder")
    status, value, detail = child.call(request)   # starts it on the first call
    child.close()

A child that died is reported by `call` (ChildDied, with its exit code) instead of a hang,
and `replace_if_dead` swaps it for a new one (started on the next call).
"""

from __future__ import annotations

import os
import queue
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from libs.process_lifetime import die_with_parent

POLL_S = 0.5
"""How often a wait for the child's reply checks that it is alive."""
CLOSE_S = 10.0


class ChildDied(RuntimeError):
    """The child process died before it answered."""


class ChildProcess:
    """The parent's handle on one spawned helper process (CUDA cannot be forked)."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        self._target, self._args, self._name = target, args, name
        self._new()

    def _new(self) -> None:
        context = mp.get_context("spawn")
        self._requests: Any = context.Queue()
        self._replies: Any = context.Queue()
        self.process = context.Process(
            target=self._target,
            args=(self._requests, self._replies, *self._args, os.getpid()),
            name=self._name,
            daemon=True,
        )

    @property
    def pid(self) -> int | None:
        """The running child's pid; None before it started."""
        return self.process.pid

    def replace_if_dead(self) -> bool:
        """Swap a child that died for a new one (not started yet); True if it did."""
        if self.process.pid is not None and not self.process.is_alive():
            self._new()
            return True
        return False

    def call(self, request: Any) -> tuple[str, Any, str]:
        """Send `request` (starting the child if needed) and wait for its answer; ChildDied
        if it dies first (it is replaced by a new one, started on the next call)."""
        self.send(request)
        return self.reply()

    def send(self, request: Any) -> None:
        """Send `request` (starting the child if needed); `reply` waits for its answer."""
        if self.process.pid is None:
            self.process.start()
        self._requests.put(request)

    def reply(self) -> tuple[str, Any, str]:
        """The answer to the oldest request sent and not answered yet; ChildDied as `call`."""
        while True:
            try:
                answer: tuple[str, Any, str] = self._replies.get(timeout=POLL_S)
                return answer
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    self._new()
                    raise ChildDied(f"exit code {code}") from None

    def kill(self) -> None:
        """Kill the child at once (a crash, for tests)."""
        self.process.kill()

    def join(self, timeout_s: float | None = None) -> None:
        self.process.join(timeout_s)

    def close(self) -> None:
        """Stop the child (it finishes the request it is on); kill it if it does not."""
        if self.process.pid is None:
            return
        self._requests.put(None)
        self.process.join(CLOSE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(CLOSE_S)


def become_child(parent: int) -> None:
    """First thing in a child: die with the parent (SIGKILL on its death), and leave the
    cores to the work's own threads rather than torch's."""
    die_with_parent(signal.SIGKILL, parent)
    torch.set_num_threads(1)
