"""`rlpipe sandbox run`: one command in exactly the sandbox an episode gets, for debugging;
`rlpipe sandbox check`: what bounds a sandbox on this host.

    rlpipe sandbox run --workdir DIR [--cpu-s 10 --memory-mb 1024 ...] -- CMD [ARG...]
    rlpipe sandbox check

DIR is copied as the seed of a fresh working folder (DIR itself is never changed), the
command runs there with the episode limits, its stdout and stderr are printed, and the
folder is removed. Standalone: `python -m apps.sandbox_cli sandbox run --workdir DIR -- ...`.
`check` prints, as JSON, the mechanisms in effect (seccomp filter, cgroup version and
controllers or why there are none, disk quota, rlimits) and exits 1 when cgroups are missing.

Exit codes:
    the command's own exit code (128 + N when killed by signal N), when no limit was hit
    124  a limit was hit (wall clock, CPU, memory, processes, file size); stderr says which
    125  the sandbox could not be set up, or a usage error
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from libs.logs import configure_logging
from libs.sandbox.base import SandboxError, SandboxResult
from libs.sandbox.config import SandboxConfig
from libs.sandbox.factory import build_sandbox_factory
from libs.sandbox.limits import MIB, SandboxLimits

EXIT_LIMIT, EXIT_SANDBOX = 124, 125
DEFAULTS = SandboxLimits()


def add_sandbox_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sandbox` and its `run` subcommand on an argparse subparsers object."""
    sandbox = subparsers.add_parser("sandbox", help="run a command in an episode's sandbox")
    commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run_parser = commands.add_parser(
        "run",
        help="run CMD in a sandbox seeded from --workdir",
        description="Run CMD in a fresh sandbox seeded with a copy of --workdir.",
        epilog=f"exit: CMD's code; {EXIT_LIMIT} a limit was hit; {EXIT_SANDBOX} sandbox error",
    )
    run_parser.add_argument("--workdir", type=Path, required=True, help="seed folder (copied)")
    run_parser.add_argument("--cpu-s", type=int, default=DEFAULTS.cpu_s, help="CPU seconds")
    run_parser.add_argument(
        "--memory-mb", type=int, default=DEFAULTS.memory_bytes // MIB, help="address space"
    )
    run_parser.add_argument(
        "--memory-total-mb",
        type=int,
        default=DEFAULTS.memory_total_bytes // MIB,
        help="memory of all processes together (cgroup), working folder included",
    )
    run_parser.add_argument(
        "--cpu-cores", type=float, default=DEFAULTS.cpu_cores, help="CPU share, all processes"
    )
    run_parser.add_argument("--max-processes", type=int, default=DEFAULTS.max_processes)
    run_parser.add_argument(
        "--disk-mb", type=int, default=DEFAULTS.disk_bytes // MIB, help="working folder size"
    )
    run_parser.add_argument(
        "--file-size-mb", type=int, default=DEFAULTS.file_size_bytes // MIB, help="largest file"
    )
    run_parser.add_argument("--wall-s", type=float, default=DEFAULTS.wall_s, help="wall clock")
    run_parser.add_argument(
        "--output-bytes", type=int, default=DEFAULTS.output_bytes, help="kept per stream"
    )
    run_parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    run_parser.set_defaults(handler=_on_run)
    check_parser = commands.add_parser(
        "check",
        help="print what bounds a sandbox on this host (JSON)",
        description="Print the sandbox's enforcement on this host; exit 1 without cgroups.",
    )
    check_parser.set_defaults(handler=_on_check)


def limits_from_args(args: argparse.Namespace) -> SandboxLimits:
    """The limits the flags name."""
    return SandboxLimits(
        cpu_s=args.cpu_s,
        memory_bytes=args.memory_mb * MIB,
        memory_total_bytes=args.memory_total_mb * MIB,
        cpu_cores=args.cpu_cores,
        max_processes=args.max_processes,
        disk_bytes=args.disk_mb * MIB,
        file_size_bytes=args.file_size_mb * MIB,
        wall_s=args.wall_s,
        output_bytes=args.output_bytes,
    )


def _on_run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ValueError("no command given: rlpipe sandbox run --workdir DIR -- CMD [ARG...]")
    if not args.workdir.is_dir():
        raise ValueError(f"--workdir {args.workdir} is not a folder")
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    result = asyncio.run(_run_once(args.workdir, command, stdin, limits_from_args(args)))
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    sys.stderr.flush()
    return _report(result)


def _on_check(args: argparse.Namespace) -> int:
    enforcement = build_sandbox_factory(SandboxConfig()).enforcement
    print(json.dumps(dict(enforcement), indent=2))
    return 1 if enforcement["cgroup"].startswith("none") else 0


async def _run_once(
    seed: Path, command: list[str], stdin: bytes | None, limits: SandboxLimits
) -> SandboxResult:
    factory = build_sandbox_factory(SandboxConfig(limits=limits))
    async with factory.open(seed) as sandbox:
        return await sandbox.run(command, stdin=stdin)


def _report(result: SandboxResult) -> int:
    """Print what the caller cannot see in the output; the exit code for it."""
    for name, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
        if cut:
            print(f"rlpipe sandbox: {name} truncated (--output-bytes)", file=sys.stderr)
    how = f"exit {result.exit_code}"
    if result.killed_by_signal is not None:
        how += f" ({signal.Signals(result.killed_by_signal).name})"
    if result.limit_hit is None:
        return result.exit_code
    print(
        f"rlpipe sandbox: limit hit: {result.limit_hit}; command ended with {how} "
        f"after {result.wall_s:.2f} s",
        file=sys.stderr,
    )
    return EXIT_LIMIT


def run(args: argparse.Namespace) -> int:
    """Run a parsed `sandbox` command, mapping errors to exit codes and one-line messages."""
    configure_logging("sandbox", level="warning")  # stdout is the command's alone
    try:
        return int(args.handler(args))
    except (SandboxError, OSError, ValueError) as exc:
        print(f"rlpipe sandbox: error: {exc}", file=sys.stderr)
        return EXIT_SANDBOX


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m apps.sandbox_cli sandbox run ...`."""
    parser = argparse.ArgumentParser(prog="rlpipe")
    add_sandbox_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
