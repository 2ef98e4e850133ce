"""Publishing a file or folder by rename, so that what a reader is told about survives an OS
crash and not only a process crash.

    partial = final.with_name(final.name + ".partial")
    write(partial)                         # a file, or a folder of files
    publish_durably(partial, final)        # then announce `final`

A rename is atomic for readers: nobody sees half a file. But it is not ordered with the data
it names: after a power loss or a kernel panic the new name can be on disk while the file's
blocks are not (delayed allocation on ext4 and XFS), and a name already announced on the bus
opens as a truncated or empty file. A process that dies (SIGKILL, out of memory) loses
nothing it wrote: the kernel still holds it. So `publish_durably` fsyncs every file under
`partial` and then every folder (their entries), renames, and fsyncs the folder that holds
`final`, so that the rename itself is on disk before anyone is told.

Used by every rename that publishes weights or a checkpoint: staged weights
(libs.weights.safetensors_io, libs.weights.container, libs.weights.handoff), trainer
checkpoints (libs.trainer.checkpoint) and SFT checkpoints (libs.sft.train). A file in
/dev/shm (tmpfs, where a staged delta may go) is gone after a reboot whatever we do: fsync
there costs nothing and promises nothing (docs/deployment.md, "What durable means").
"""

from __future__ import annotations

import os
from pathlib import Path


def publish_durably(partial: Path, final: Path) -> None:
    """Make `partial` (a file, or a folder and all in it) durable, rename it to `final`
    (replacing a file there, or an empty folder), and make the rename durable."""
    sync_tree(partial)
    os.replace(partial, final)
    sync_folder(final.parent)


def sync_tree(path: Path) -> None:
    """fsync `path`; for a folder, every file under it, then each folder after what it holds.
    A symbolic link is not followed: the fsync of the folder holding it records it."""
    if path.is_symlink():
        return
    if not path.is_dir():
        _fsync(path, os.O_RDONLY)
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():
                _fsync(file, os.O_RDONLY)
        sync_folder(Path(root))


def sync_folder(path: Path) -> None:
    """fsync a folder: its entries (names created, renamed or removed in it) reach the disk."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
