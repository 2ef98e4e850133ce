"""The test runner that runs INSIDE a sandbox, with the system `python3` (stdlib only).

The host runs it as `python3 -I -c <this file's text> MODE`; it is never a file the agent
can see or change. Two modes:

- `visible`: runs every `test_*` function of the working folder's `test_*.py` files (top level
  and `tests/`) and prints PASS/FAIL lines with tracebacks and a summary; exits 1 if any test
  failed or none was found. This is the agent's `run_tests` tool: a convenience, not a verdict.
- `cases`: reads `{"nonce", "setup", "cases": [{"name", "code"}], "case_timeout_s"}` as JSON
  from stdin before any agent code runs, executes `setup` (which imports the agent's code),
  then each case's `code` (an expression, or statements that set `result`), and reports one
  line per case, `<nonce> {"name", "outcome": "value"|"raised"|"error", "value"}`, then
  `<nonce> {"end": true}`, on a duplicate of stdout; the agent's own prints go to /dev/null.
  Values are reported as plain JSON (exact types only); the verdict is made on the host,
  against expected values that never enter the sandbox (see grading.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import traceback
from typing import Any

MAX_DEPTH = 32


class CaseTimeout(BaseException):
    """A case ran past its time (a BaseException, so `except Exception` cannot hide it)."""


def canonical(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON data, refusing subclasses and other types."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply")
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise TypeError("non-finite float")
        return value
    if kind in (list, tuple):
        return [canonical(item, depth + 1) for item in value]
    if kind is dict:
        if not all(type(key) is str for key in value):
            raise TypeError("dict keys must be str")
        return {key: canonical(item, depth + 1) for key, item in value.items()}
    raise TypeError("cannot report a value of type " + kind.__name__)


def run_code(code: str, namespace: dict[str, Any]) -> Any:
    try:
        compiled = compile(code, "<case>", "eval")
    except SyntaxError:
        exec(compile(code, "<case>", "exec"), namespace)
        return namespace.get("result")
    return eval(compiled, namespace)


def on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


def run_cases() -> int:
    request = json.loads(sys.stdin.buffer.read())
    nonce = request["nonce"]
    timeout_s = float(request.get("case_timeout_s", 2.0))
    report_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)

    def emit(record: dict[str, Any]) -> None:
        os.write(report_fd, (nonce + " " + json.dumps(record) + "\n").encode())

    sys.path.insert(0, os.getcwd())
    signal.signal(signal.SIGALRM, on_alarm)
    base: dict[str, Any] = {"__name__": "hidden_cases"}
    setup_error = ""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        exec(compile(request["setup"], "<setup>", "exec"), base)
    except BaseException as exc:
        setup_error = "setup raised " + type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for case in request["cases"]:
        record: dict[str, Any] = {"name": case["name"]}
        if setup_error:
            record.update(outcome="error", value=setup_error)
            emit(record)
            continue
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = run_code(case["code"], dict(base))
            signal.setitimer(signal.ITIMER_REAL, 0)
            record.update(outcome="value", value=canonical(value))
        except CaseTimeout:
            record.update(outcome="error", value="timed out")
        except TypeError as exc:
            record.update(outcome="raised", value="TypeError", detail=str(exc)[:200])
        except BaseException as exc:
            record.update(outcome="raised", value=type(exc).__name__)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        emit(record)
    emit({"end": True})
    return 0


def test_files() -> list[str]:
    found: list[str] = []
    for folder in (".", "tests"):
        if os.path.isdir(folder):
            names = sorted(n for n in os.listdir(folder) if n.startswith("test_"))
            found += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return [os.path.normpath(path) for path in found]


def run_visible() -> int:
    import importlib.util

    sys.path.insert(0, os.getcwd())
    passed = failed = 0
    for number, path in enumerate(test_files()):
        spec = importlib.util.spec_from_file_location(f"visible_test_{number}", path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            failed += 1
            print("ERROR " + path + " (import failed)\n" + traceback.format_exc(limit=-3))
            continue
        for name, function in list(vars(module).items()):
            if not name.startswith("test_") or not callable(function):
                continue
            try:
                function()
            except BaseException:
                failed += 1
                print("FAIL " + path + "::" + name + "\n" + traceback.format_exc(limit=-3))
            else:
                passed += 1
                print("PASS " + path + "::" + name)
    print(f"{passed} passed, {failed} failed")
    return 0 if passed and not failed else 1


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "cases":
        return run_cases()
    if mode == "visible":
        return run_visible()
    print("usage: runner (visible|cases)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.stdout.flush()
    sys.exit(main())
