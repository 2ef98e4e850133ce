"""The file tools' side INSIDE a sandbox, with the system `python3` (stdlib only).

Run as `python3 -I -c <this file's text> OP PATH [MAX_BYTES]` in the working folder:

- `read PATH MAX_BYTES`: the file's bytes on stdout (the first MAX_BYTES);
- `write PATH`: stdin becomes the file (parent folders are created);
- `list PATH MAX_BYTES`: one `<relative path>\t<size>` line per file under PATH, sorted.

Paths resolve (symlinks included) inside the working folder or are refused. Exit codes:
0 ok, 2 failed (not found, a folder, ...), 3 denied (outside the working folder).
"""

from __future__ import annotations

import os
import sys

EXIT_FAILED, EXIT_DENIED = 2, 3
MAX_ENTRIES = 500


def inside(path: str) -> str | None:
    root = os.path.realpath(os.getcwd())
    full = os.path.realpath(os.path.join(root, path))
    if full == root or full.startswith(root + os.sep):
        return full
    return None


def fail(message: str, code: int = EXIT_FAILED) -> int:
    sys.stderr.write(message + "\n")
    return code


def read(full: str, max_bytes: int) -> int:
    if not os.path.isfile(full):
        return fail("no such file" if not os.path.exists(full) else "not a regular file")
    with open(full, "rb") as file:
        data = file.read(max_bytes + 1)
    sys.stdout.buffer.write(data[:max_bytes])
    if len(data) > max_bytes:
        sys.stderr.write(f"truncated at {max_bytes} bytes\n")
    return 0


def write(full: str) -> int:
    if os.path.isdir(full):
        return fail("a folder has that name")
    data = sys.stdin.buffer.read()
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as file:
        file.write(data)
    sys.stdout.write(f"wrote {len(data)} bytes\n")
    return 0


def list_files(full: str) -> int:
    if not os.path.isdir(full):
        return fail("no such folder")
    root = os.path.realpath(os.getcwd())
    lines: list[str] = []
    for folder, dirs, files in os.walk(full):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            size = os.lstat(path).st_size
            lines.append(f"{os.path.relpath(path, root)}\t{size}")
    lines.sort()
    more = len(lines) - MAX_ENTRIES
    out = "\n".join(lines[:MAX_ENTRIES]) + (f"\n... {more} more files" if more > 0 else "")
    sys.stdout.write(out + "\n")
    return 0


def main() -> int:
    op, path = sys.argv[1], sys.argv[2]
    max_bytes = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    full = inside(path)
    if full is None:
        return fail("path is outside the working folder", EXIT_DENIED)
    try:
        if op == "read":
            return read(full, max_bytes)
        if op == "write":
            return write(full)
        if op == "list":
            return list_files(full)
    except OSError as exc:
        return fail(exc.strerror or str(exc))
    return fail("unknown operation " + op)


if __name__ == "__main__":
    sys.exit(main())
