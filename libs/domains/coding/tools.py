"""The coding environment's tools, each run inside the episode's sandbox.

    read_file(path)                  the file's text (the first `max_read_bytes`)
    write_file(path, content)        create or replace a file (parent folders are created)
    list_files(path=".")             every file under `path` with its size
    run_python(code | path, args=[]) run a snippet (`python3 -c code`) or a file
    run_tests()                      run the visible tests (test_*.py) with a stdlib runner

Paths are relative to the working folder (or absolute under the sandbox's mount path); one
outside it is refused (`denied`). Every outcome is a ToolResult: the error kind says what went
wrong (proto.messages.TOOL_ERROR_*). A sandbox limit is `limit_exceeded` or `timeout`; a
command that fails on what the sandbox refuses (the network, a read-only or absent path) is
`denied`; any other non-zero exit is `failed`. Even the file tools run in the sandbox: only
its processes ever touch the working folder, so a symlink the agent planted resolves inside
the sandbox, never on the host.
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.domains.coding.grading import RUNNER_PYTHON, RUNNER_SOURCE
from libs.sandbox import Sandbox, SandboxResult
from proto.messages import (
    TOOL_ERROR_BAD_ARGUMENTS,
    TOOL_ERROR_DENIED,
    TOOL_ERROR_FAILED,
    TOOL_ERROR_LIMIT,
    TOOL_ERROR_TIMEOUT,
    TOOL_ERROR_UNKNOWN_TOOL,
    ToolCall,
    ToolResult,
    ToolSpec,
)

FILES_SOURCE = (Path(__file__).parent / "sandbox_files.py").read_text()
EXIT_FAILED, EXIT_DENIED = 2, 3  # sandbox_files.py's exit codes
MIN_CALL_S = 0.5  # a call needs at least this much of the step's time budget to start
# What a failed command prints when the sandbox refused it (no network, read-only system).
DENIED_MARKERS = re.compile(
    rb"Network is unreachable|Temporary failure in name resolution|Name or service not known"
    rb"|Read-only file system|Permission denied|Operation not permitted"
)


def _object(properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "path relative to the working folder"}
TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="read_file",
        description="Read a text file.",
        parameters=_object({"path": _PATH}, ["path"]),
    ),
    ToolSpec(
        name="write_file",
        description="Create or replace a file with `content`.",
        parameters=_object({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    ),
    ToolSpec(
        name="list_files",
        description="List the files under a folder (default: the working folder).",
        parameters=_object({"path": _PATH}),
    ),
    ToolSpec(
        name="run_python",
        description="Run Python: a snippet (`code`) or a file (`path`), with optional `args`.",
        parameters=_object(
            {
                "code": {"type": "string"},
                "path": _PATH,
                "args": {"type": "array", "items": {"type": "string"}},
            }
        ),
    ),
    ToolSpec(
        name="run_tests",
        description="Run the visible tests (test_*.py) and report each pass or failure.",
        parameters=_object({}),
    ),
)


@dataclass(frozen=True)
class ToolLimits:
    """How much a tool may return and how long a step's calls may take together."""

    max_output_chars: int = 4000
    max_read_bytes: int = 64 * 1024
    step_budget_s: float = 20.0


class ToolFailure(Exception):
    """A call that ends with an error kind before anything runs."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Handler = Callable[[dict[str, Any], float], Awaitable[tuple[str, str]]]


class SandboxTools:
    """Runs the tool calls of one episode in its sandbox."""

    def __init__(self, sandbox: Sandbox, limits: ToolLimits | None = None) -> None:
        self.sandbox = sandbox
        self.limits = limits or ToolLimits()
        self._handlers: dict[str, Handler] = {
            "read_file": self.read_file,
            "write_file": self.write_file,
            "list_files": self.list_files,
            "run_python": self.run_python,
            "run_tests": self.run_tests,
        }

    async def run_all(self, calls: Sequence[ToolCall]) -> tuple[ToolResult, ...]:
        """Run `calls` in order within the step's time budget; one result per call."""
        deadline = time.monotonic() + self.limits.step_budget_s
        results = []
        for call in calls:
            remaining_s = deadline - time.monotonic()
            if remaining_s < MIN_CALL_S:
                message = f"not run: this turn's calls used up their {self.limits.step_budget_s} s"
                results.append(_result(call, message, TOOL_ERROR_TIMEOUT))
            else:
                results.append(await self.call(call, remaining_s))
        return tuple(results)

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        handler = self._handlers.get(call.name)
        if handler is None:
            offered = ", ".join(self._handlers)
            return _result(
                call, f"unknown tool {call.name!r}; tools: {offered}", TOOL_ERROR_UNKNOWN_TOOL
            )
        try:
            content, error = await handler(call.arguments, timeout_s)
        except ToolFailure as exc:
            return _result(call, str(exc), exc.kind)
        return _result(call, content, error)

    async def read_file(self, args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        _only(args, "path")
        path = self._path(args, "path")
        max_bytes = str(self.limits.max_read_bytes)
        result = await self._run(_files_command("read", path, max_bytes), timeout_s)
        if result.ok:
            cut = f"\n[cut at {max_bytes} bytes]" if b"truncated" in result.stderr else ""
            return result.stdout.decode(errors="replace") + cut, ""
        return self._file_failure(result)

    async def write_file(self, args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        _only(args, "path", "content")
        path = self._path(args, "path")
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolFailure(TOOL_ERROR_BAD_ARGUMENTS, '"content" must be a string')
        result = await self._run(_files_command("write", path), timeout_s, content.encode())
        if result.ok:
            return f"wrote {path} ({len(content.encode())} bytes)", ""
        return self._file_failure(result)

    async def list_files(self, args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        _only(args, "path")
        path = self._path(args, "path", default=".")
        result = await self._run(_files_command("list", path), timeout_s)
        if result.ok:
            return result.stdout.decode(errors="replace") or "(no files)", ""
        return self._file_failure(result)

    async def run_python(self, args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        _only(args, "code", "path", "args")
        extra = args.get("args", [])
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            raise ToolFailure(TOOL_ERROR_BAD_ARGUMENTS, '"args" must be a list of strings')
        code, has_path = args.get("code"), "path" in args
        if (code is None) == (not has_path):
            raise ToolFailure(TOOL_ERROR_BAD_ARGUMENTS, 'give exactly one of "code" or "path"')
        if code is not None and not isinstance(code, str):
            raise ToolFailure(TOOL_ERROR_BAD_ARGUMENTS, '"code" must be a string')
        target = ["-c", code] if code is not None else ["./" + self._path(args, "path")]
        # -B: no bytecode that a later run would import in place of a rewritten file.
        result = await self._run(["python3", "-B", *target, *extra], timeout_s)
        return self._describe(result), command_error(result)

    async def run_tests(self, args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        _only(args)
        result = await self._run([*RUNNER_PYTHON, "-c", RUNNER_SOURCE, "visible"], timeout_s)
        return self._describe(result), command_error(result)

    async def _run(
        self, command: list[str], timeout_s: float, stdin: bytes | None = None
    ) -> SandboxResult:
        return await self.sandbox.run(command, stdin=stdin, timeout_s=timeout_s)

    def _path(self, args: dict[str, Any], key: str, default: str | None = None) -> str:
        """`args[key]` as a normalized path relative to the working folder."""
        value = args.get(key, default)
        if not isinstance(value, str) or not value or "\0" in value:
            raise ToolFailure(TOOL_ERROR_BAD_ARGUMENTS, f'"{key}" must be a non-empty path')
        mount = self.sandbox.mount_path
        if value.startswith("/"):
            if value != mount and not value.startswith(mount + "/"):
                raise ToolFailure(
                    TOOL_ERROR_DENIED, f"{value} is outside the working folder {mount}"
                )
            value = posixpath.relpath(value, mount)
        normal = posixpath.normpath(value)
        if normal == ".." or normal.startswith("../"):
            raise ToolFailure(TOOL_ERROR_DENIED, f"{value} is outside the working folder {mount}")
        return normal

    def _file_failure(self, result: SandboxResult) -> tuple[str, str]:
        message = result.stderr.decode(errors="replace").strip()
        if result.limit_hit is not None or result.exit_code not in (EXIT_FAILED, EXIT_DENIED):
            return self._describe(result), command_error(result) or TOOL_ERROR_FAILED
        kind = TOOL_ERROR_DENIED if result.exit_code == EXIT_DENIED else TOOL_ERROR_FAILED
        return message, kind

    def _describe(self, result: SandboxResult) -> str:
        """Exit code, the limit hit, and both output streams (each clipped)."""
        lines = [f"exit code: {result.exit_code}"]
        if result.limit_hit is not None:
            lines.append(f"limit hit: {result.limit_hit} (the command was stopped)")
        for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            if data:
                text = clip(data.decode(errors="replace"), self.limits.max_output_chars)
                lines.append(f"--- {name} ---\n{text}")
        return "\n".join(lines)


def command_error(result: SandboxResult) -> str:
    """The ToolResult error kind of a finished command ("" when it succeeded)."""
    if result.limit_hit == "wall":
        return TOOL_ERROR_TIMEOUT
    if result.limit_hit is not None:
        return TOOL_ERROR_LIMIT
    if result.exit_code != 0:
        return TOOL_ERROR_DENIED if DENIED_MARKERS.search(result.stderr) else TOOL_ERROR_FAILED
    return ""


def clip(text: str, max_chars: int) -> str:
    """`text`, or its head and tail around a note of how much was cut."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _files_command(op: str, path: str, *extra: str) -> list[str]:
    return ["python3", "-I", "-c", FILES_SOURCE, op, path, *extra]


def _only(args: dict[str, Any], *allowed: str) -> None:
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        expected = ", ".join(allowed) or "none"
        raise ToolFailure(
            TOOL_ERROR_BAD_ARGUMENTS, f"unknown arguments {unknown}; expected: {expected}"
        )


def _result(call: ToolCall, content: str, error: str = "") -> ToolResult:
    return ToolResult(call_id=call.call_id, name=call.name, content=content, error=error)
