"""The host side of the sandboxes' files: their root folder, the synthetic /etc, the
read-only system mounts, seed checks, and removing a working folder's home.

    root = prepare_root(Path("/tmp/rlpipe-sandboxes-0"))
    args = system_mount_args(write_etc(root, "/workspace"))   # bubblewrap's mount options
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from libs.sandbox.base import SandboxError

SANDBOX_ID = 1000  # uid and gid of the command inside the sandbox
SYSTEM_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "sandbox:x:{id}:{id}:sandbox:{home}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nsandbox:x:{id}:\nnogroup:x:65534:\n"


MAX_SEED_BYTES = 1 << 30


def check_seed_dir(seed_dir: Path, root_dir: Path, max_bytes: int = MAX_SEED_BYTES) -> None:
    """Refuse a seed folder that cannot be copied into a sandbox.

    A seed holding the sandboxes' own root (`--workdir /tmp`) would copy itself into
    itself until the disk is full (it did, once); a huge seed is almost always a mistake.
    """
    if not seed_dir.is_dir():
        raise ValueError(f"seed_dir {seed_dir} is not a folder: give the task's files folder")
    seed, root = seed_dir.resolve(), root_dir.resolve()
    if root == seed or seed in root.parents:
        raise ValueError(
            f"seed_dir {seed_dir} contains the sandboxes' own folder {root_dir}: "
            "give the task's files folder, not a parent of it"
        )
    total = 0
    for folder, _, files in os.walk(seed):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(folder) / name).lstat().st_size
            if total > max_bytes:
                raise ValueError(
                    f"seed_dir {seed_dir} holds more than {max_bytes >> 20} MiB: a sandbox gets "
                    "a copy of it, so give a folder with just the task's files"
                )


def prepare_root(root: Path) -> Path:
    """The folder of working folders, traversable (not listable) by the sandbox user."""
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise SandboxError(f"sandbox root {root} must be a folder owned by uid {os.geteuid()}")
    root.chmod(0o711)
    return root


def write_etc(root: Path, mount_path: str) -> dict[str, Path]:
    """The synthetic /etc files, by their path inside the sandbox."""
    etc = root / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    return {
        "/etc/passwd": _write_once(etc, "passwd", PASSWD.format(id=SANDBOX_ID, home=mount_path)),
        "/etc/group": _write_once(etc, "group", GROUP.format(id=SANDBOX_ID)),
    }


def _write_once(folder: Path, stem: str, text: str) -> Path:
    """`folder/stem-<digest of text>`, written if absent and never replaced afterwards.

    Other factories (other processes, other mount paths) share the root, and their sandboxes
    may be binding these files right now: bubblewrap fails on a source replaced under it
    ("Unable to find ... (deleted) in mount table"), so a file, once there, stays as it is.
    """
    path = folder / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if path.exists():
        return path
    fd, temporary = tempfile.mkstemp(dir=folder)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o644)
        with contextlib.suppress(FileExistsError):  # another factory wrote the same text first
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
    return path


def system_mount_args(etc_files: dict[str, Path]) -> list[str]:
    """Read-only /usr, the top-level /bin, /lib* (links kept links) and a minimal /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_TOP_DIRS:
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    etc_names = [*ETC_ENTRIES, *sorted(p.name for p in Path("/etc").glob("python3*"))]
    for name in etc_names:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for inside, source in etc_files.items():
        args += ["--ro-bind", str(source), inside]
    return args


def chown_tree(top: Path, uid: int, gid: int) -> None:
    os.chown(top, uid, gid, follow_symlinks=False)
    for folder, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)


def remove_tree(top: Path) -> None:
    """Remove a working folder, even one whose modes the sandboxed code changed."""

    def make_writable_and_retry(function: Any, path: str, _exc: Any) -> None:
        parent = os.path.dirname(path)
        with contextlib.suppress(OSError, NotImplementedError):
            os.chmod(parent, 0o700)
            os.chmod(path, 0o700, follow_symlinks=False)
        with contextlib.suppress(FileNotFoundError):
            function(path)

    shutil.rmtree(top, onerror=make_writable_and_retry)
