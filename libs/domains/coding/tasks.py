"""The coding environment's tasks: folders of data shipped inside the package.

    libs/domains/coding/tasks/<name>/
        task.toml           prompt = "...", difficulty = 1..3, protected = [...] (optional)
        files/              the agent's starting working folder (code and visible tests);
                            its functions are stubs that raise NotImplementedError on
                            purpose: writing them is the task
        reference/          a reference solution: files that replace the starting ones
        hidden_tests/cases.toml
                            setup = "from solution import f"; [[case]] name, code (an
                            expression, or statements that set `result`), and `expected`
                            (a TOML value), `expected_json` (JSON text) or `raises` (an
                            exception class name)

Only `files/` is ever copied into a sandbox. Hidden cases reach a sandbox only at grading,
through stdin (never as a file), and without their expected values, which stay on the host.
"""

from __future__ import annotations

import abc
import fnmatch
import functools
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from libs.envs.base import SeededTaskSource, TaskSource

ENV_NAME = "coding"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MAX_DIFFICULTY = 3
# Files restored from the task before grading, whatever the agent did to them.
PROTECTED_PATTERNS = ("test_*.py", "*_test.py", "conftest.py", "*.toml", "*.cfg", "*.ini")


@dataclass(frozen=True)
class HiddenCase:
    """One hidden check: run `code`, expect `expected` (a JSON value) or `raises`."""

    name: str
    code: str
    expected: Any = None
    raises: str = ""


@dataclass(frozen=True)
class CodingTask:
    """A task's data on the host."""

    name: str
    prompt: str
    difficulty: int
    folder: Path
    setup: str
    cases: tuple[HiddenCase, ...]
    protected: tuple[str, ...]

    @property
    def files_dir(self) -> Path:
        return self.folder / "files"

    @property
    def reference_dir(self) -> Path:
        return self.folder / "reference"

    def file_names(self) -> list[str]:
        """Relative paths of the starting files, sorted."""
        return sorted(
            p.relative_to(self.files_dir).as_posix()
            for p in self.files_dir.rglob("*")
            if p.is_file()
        )


def load_task(folder: Path) -> CodingTask:
    """Read one task folder; ValueError names the file and the field that is wrong."""
    meta = tomllib.loads((folder / "task.toml").read_text())
    hidden = tomllib.loads((folder / "hidden_tests" / "cases.toml").read_text())
    cases = tuple(_case(folder.name, raw) for raw in hidden.get("case", []))
    if not cases or not isinstance(hidden.get("setup"), str):
        raise ValueError(f"task {folder.name}: hidden_tests/cases.toml needs setup and [[case]]s")
    if len({c.name for c in cases}) != len(cases):
        raise ValueError(f"task {folder.name}: hidden case names must be unique")
    starting = [p.relative_to(folder / "files").as_posix() for p in (folder / "files").rglob("*")]
    extra = tuple(meta.get("protected", ()))
    protected = tuple(
        sorted(p for p in starting if p in extra or _matches_protected(p.rsplit("/", 1)[-1]))
    )
    return CodingTask(
        name=folder.name,
        prompt=str(meta["prompt"]),
        difficulty=int(meta.get("difficulty", 1)),
        folder=folder,
        setup=hidden["setup"],
        cases=cases,
        protected=protected,
    )


def _matches_protected(file_name: str) -> bool:
    return any(fnmatch.fnmatch(file_name, pattern) for pattern in PROTECTED_PATTERNS)


def _case(task_name: str, raw: dict[str, Any]) -> HiddenCase:
    name, code = raw.get("name"), raw.get("code")
    if not isinstance(name, str) or not isinstance(code, str):
        raise ValueError(f"task {task_name}: every [[case]] needs a string name and code")
    if "raises" in raw:
        return HiddenCase(name, code, raises=str(raw["raises"]))
    if "expected_json" in raw:
        return HiddenCase(name, code, expected=json.loads(raw["expected_json"]))
    if "expected" in raw:
        return HiddenCase(name, code, expected=raw["expected"])
    raise ValueError(f"task {task_name}: case {name} needs expected, expected_json or raises")


@functools.cache
def load_tasks(tasks_dir: Path = TASKS_DIR) -> dict[str, CodingTask]:
    """Every task under `tasks_dir`, by name."""
    folders = sorted(p for p in tasks_dir.iterdir() if (p / "task.toml").is_file())
    return {folder.name: load_task(folder) for folder in folders}


class CodingTasks(SeededTaskSource):
    """The shipped tasks in a seeded order: each pass over them is its own shuffle.

    Difficulty 0 serves every task; d in 1..3 serves the tasks of difficulty <= d.
    """

    env: ClassVar[str] = ENV_NAME
    max_difficulty: ClassVar[int] = MAX_DIFFICULTY

    def __init__(self, *, difficulty: int, group_size: int, seed: int) -> None:
        super().__init__(difficulty=difficulty, group_size=group_size, seed=seed)
        tasks = load_tasks()
        self.names = sorted(
            n for n, t in tasks.items() if not difficulty or t.difficulty <= difficulty
        )

    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        epoch, position = divmod(index, len(self.names))
        order = list(self.names)
        self.rng(epoch).shuffle(order)
        name = order[position]
        return load_tasks()[name].prompt, {"task": name}


class TaskSet(abc.ABC):
    """The tasks a coding environment serves: found by a Task's spec, drawn by a source."""

    @abc.abstractmethod
    def find(self, spec: Mapping[str, Any]) -> CodingTask | None:
        """The task `spec` names, or None when it names none of this set."""

    @abc.abstractmethod
    def source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        """The set's tasks in a seeded order."""


class ShippedTasks(TaskSet):
    """The task folders shipped with the package (spec {"task": <folder name>})."""

    def find(self, spec: Mapping[str, Any]) -> CodingTask | None:
        name = spec.get("task")
        return load_tasks().get(name) if isinstance(name, str) else None

    def source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return CodingTasks(difficulty=difficulty, group_size=group_size, seed=seed)
