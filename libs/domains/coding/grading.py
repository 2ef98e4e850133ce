"""Grading a coding episode: the hidden cases, run on a copy of the final files, judged on the host.

    grade = await grade_files(task, final_dir, factory)      # Grade(tests_passed, tests_total, ...)

Steps: copy the regular files of the agent's working folder (never following a symlink, at
most MAX_FINAL_BYTES) into a fresh folder; put back the task's protected files (tests,
config) whatever the agent did to them; open a fresh sandbox on that copy; run the stdlib
runner (`sandbox_runner.py`, passed as `python3 -I -c`, so no file of the agent's can stand
in for it) in `cases` mode with the hidden setup and case code on stdin.

Threat model. The agent's code runs inside the grading process (it is what is tested), so it
can print anything, exit with any code, patch the runner, read the runner's memory (the nonce
included) and the hidden case code. What it cannot reach is the expected values: they never
enter any sandbox; the runner only reports what each case returned (exact JSON types) or
raised, and the host compares that with the expected value. So a forged report passes a case
only if it carries the right value for the hidden inputs, which is what solving the task
means. Printed text ("all tests passed"), an exit code of 0, deleting or editing test files,
and skipping cases earn nothing: a case passes only on a report line that carries this
run's random nonce and the right value; a case with no such line fails. The exit code and
limits decide whether the run is complete (else `grading_notes` says why, and the cases it
did not report fail). Hidden cases never exist as files: during the episode they are on the
host only, at grading they travel on stdin.

`grading_error` is set only when grading itself could not run (the sandbox failed); a
solution that crashes, hangs or cheats is judged, with `tests_passed` counting what passed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.domains.coding.tasks import CodingTask, HiddenCase
from libs.malformed_input import MALFORMED_INPUT_ERRORS
from libs.sandbox import SandboxError, SandboxFactory, SandboxResult

RUNNER_SOURCE = (Path(__file__).parent / "sandbox_runner.py").read_text()
# How the runner is started: isolated (-I: no file of the agent's shadows its imports) and
# writing no bytecode (-B): a solution rewritten in the second its last test run cached it,
# at the same size (one constant changed), was imported from the stale .pyc by the next run.
RUNNER_PYTHON = ("python3", "-I", "-B")
MAX_FINAL_BYTES = 8 << 20
MAX_FINAL_FILES = 2000
SKIPPED_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Grade:
    """The verdict on an episode's final files, as the episode's final `info`."""

    tests_passed: int
    tests_total: int
    grading_error: str = ""
    notes: str = ""

    def info(self) -> dict[str, Any]:
        solved = self.tests_total > 0 and self.tests_passed == self.tests_total
        return {
            # The episode's verdict, as every domain states it (success in reports).
            "answer_correct": solved and not self.grading_error,
            "tests_passed": self.tests_passed,
            "tests_total": self.tests_total,
            "grading_error": self.grading_error,
            "grading_notes": self.notes,
        }


async def grade_files(
    task: CodingTask,
    final_dir: Path,
    factory: SandboxFactory,
    *,
    case_timeout_s: float = 2.0,
    wall_s: float = 20.0,
) -> Grade:
    """Run `task`'s hidden cases against the files in `final_dir` (which is not changed)."""
    total = len(task.cases)
    nonce = secrets.token_hex(16)
    request = {
        "nonce": nonce,
        "setup": task.setup,
        "cases": [{"name": c.name, "code": c.code} for c in task.cases],
        "case_timeout_s": case_timeout_s,
    }
    with tempfile.TemporaryDirectory(prefix="rlpipe-grade-") as scratch:
        seed = Path(scratch) / "final"
        await asyncio.to_thread(copy_final_files, final_dir, seed)
        await asyncio.to_thread(restore_protected, task, seed)
        try:
            async with factory.open(seed) as sandbox:
                result = await sandbox.run(
                    [*RUNNER_PYTHON, "-c", RUNNER_SOURCE, "cases"],
                    stdin=json.dumps(request).encode(),
                    timeout_s=wall_s,
                )
        except SandboxError as exc:
            return Grade(0, total, grading_error=f"the grading sandbox failed: {exc}")
    return judge(task.cases, result, nonce)


def judge(cases: tuple[HiddenCase, ...], result: SandboxResult, nonce: str) -> Grade:
    """Count the cases whose report line (carrying `nonce`) matches the expected outcome."""
    reports, ended = read_reports(result.stdout, nonce)
    passed = sum(case_passed(case, reports.get(case.name)) for case in cases)
    notes = ""
    if not ended or result.exit_code != 0 or result.limit_hit is not None:
        limit = f", limit hit: {result.limit_hit}" if result.limit_hit else ""
        notes = (
            f"the test run did not finish cleanly (exit {result.exit_code}{limit}); "
            f"{len(reports)} of {len(cases)} cases reported, the rest count as failed"
        )
    return Grade(passed, len(cases), notes=notes)


def read_reports(stdout: bytes, nonce: str) -> tuple[dict[str, dict[str, Any]], bool]:
    """The first report per case name among lines starting with `nonce`, and whether the
    end marker came."""
    prefix = f"{nonce} ".encode()
    reports: dict[str, dict[str, Any]] = {}
    ended = False
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix) :])
        except MALFORMED_INPUT_ERRORS:  # the agent's code shares the runner's process
            continue
        if not isinstance(record, dict):
            continue
        if record.get("end") is True:
            ended = True
        elif isinstance(record.get("name"), str) and not ended:
            reports.setdefault(record["name"], record)
    return reports, ended


def case_passed(case: HiddenCase, report: dict[str, Any] | None) -> bool:
    if report is None:
        return False
    if case.raises:
        return report.get("outcome") == "raised" and report.get("value") == case.raises
    return report.get("outcome") == "value" and same_value(report.get("value"), case.expected)


def same_value(actual: Any, expected: Any) -> bool:
    """JSON values equal, numbers compared as numbers (2 == 2.0, within 1e-9), bools only
    equal to bools."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(map(same_value, actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            same_value(actual[k], expected[k]) for k in expected
        )
    return type(actual) is type(expected) and actual == expected


def copy_final_files(source: Path, dest: Path) -> None:
    """Copy the regular files under `source` to `dest`: symlinks, fifos and devices are
    skipped, never followed; copying stops at MAX_FINAL_FILES files or MAX_FINAL_BYTES."""
    dest.mkdir(parents=True)
    budget, count = MAX_FINAL_BYTES, 0
    for folder, dirs, files in os.walk(source, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        relative = Path(folder).relative_to(source)
        for name in sorted(files):
            copied = _copy_regular(Path(folder) / name, dest / relative / name, budget)
            if copied >= 0:
                budget -= copied
                count += 1
            if count >= MAX_FINAL_FILES or budget <= 0:
                return


def _copy_regular(path: Path, target: Path, budget: int) -> int:
    """Copy `path` if it is a regular file that fits `budget`; its size, or -1 if skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return -1
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > budget:
            return -1
        data = file.read(budget + 1)
    if len(data) > budget:
        return -1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return len(data)


def restore_protected(task: CodingTask, dest: Path) -> None:
    """Put the task's protected files back as the task ships them."""
    for relative in task.protected:
        target = dest / relative
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(task.files_dir / relative, target)
