"""The trainer's checkpointer: resumes a learner from the latest checkpoint, and saves one
when the trainer asks, beside training when it can.

    checkpointer = Checkpointer(checkpoint_dir, learner, tokenizer, config)
    state = checkpointer.resume()                 # the latest checkpoint's state, or None
    await checkpointer.save(state, protected)     # in the background when it can
    await checkpointer.written()                  # the background write done (or raised)
    await checkpointer.save_in_line(state, protected)
    checkpointer.saved_step                       # the step of the last checkpoint written

A background save copies the learner's tensors to host buffers kept from save to save
(libs.trainer.host_memory), then writes that copy while training goes on; one write runs
at a time, and a failed write raises at the next save or at `written`. A learner whose
tensors can only be written in line (the N ranks' save is a collective) is saved in line.
The folder layout, the pruning and the versions that are never pruned are
libs.trainer.checkpoint's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from libs.tokenizer import Tokenizer
from libs.trainer.checkpoint import TrainerState, latest_checkpoint, write_checkpoint
from libs.trainer.config import TrainerConfig
from libs.trainer.host_memory import HostCopy
from libs.trainer.learner import Learner

log = structlog.get_logger(__name__)


class Checkpointer:
    """Saves and resumes one learner's checkpoints in `directory`."""

    def __init__(
        self, directory: Path, learner: Learner, tokenizer: Tokenizer, config: TrainerConfig
    ) -> None:
        self.directory = directory
        self._learner = learner
        self._tokenizer = tokenizer
        self._keep = config.checkpoint_keep
        self._background = config.checkpoint_in_background
        self._host = HostCopy()
        self._writing: asyncio.Task[None] | None = None  # the background write, if one runs
        self.saved_step: int | None = None

    def resume(self) -> TrainerState | None:
        """Load the latest checkpoint into the learner; its state (None: no checkpoint)."""
        checkpoint = latest_checkpoint(self.directory)
        if checkpoint is None:
            return None
        self._learner.load(checkpoint.path)
        self.saved_step = checkpoint.state.step
        log.info("resumed", step=checkpoint.state.step, checkpoint=str(checkpoint.path))
        return checkpoint.state

    async def save(self, state: TrainerState, protected: set[int]) -> None:
        """A checkpoint of `state` and the learner's tensors as they are now, written in the
        background from a host copy when the learner can make one."""
        await self.written()  # its host buffers are the next copy's
        if self._background:
            copy = await asyncio.to_thread(self._learner.snapshot_tensors, self._host)
            if copy is not None:
                write = self._writer(state, protected, copy)
                self._writing = asyncio.create_task(
                    asyncio.to_thread(write), name="checkpoint-write"
                )
                return
        await self.save_in_line(state, protected)

    async def save_in_line(self, state: TrainerState, protected: set[int]) -> None:
        """A checkpoint of `state` and the learner's tensors, written now."""
        await asyncio.to_thread(self._writer(state, protected, self._learner.write_tensors))

    async def written(self) -> None:
        """Wait for the checkpoint being written in the background, if any."""
        task, self._writing = self._writing, None
        if task is not None:
            await task

    def _writer(
        self, state: TrainerState, protected: set[int], write_tensors: Callable[[Path], None]
    ) -> Callable[[], None]:
        """A writer of the checkpoint of `state` as it is now (training may change it)."""
        frozen = msgspec.json.decode(msgspec.json.encode(state), type=TrainerState)

        def write() -> None:
            path = write_checkpoint(
                self.directory,
                frozen,
                write_tensors,
                self._tokenizer,
                keep=self._keep,
                protected=protected,
            )
            self.saved_step = frozen.step
            log.info("checkpoint saved", path=str(path))

        return write
