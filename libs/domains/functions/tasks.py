"""The `functions` domain's tasks: generated coding tasks, made from a Task's spec.

A task's spec is `{"family": name, "params": {...}}` (families.py): everything else, the
prompt, the stub, the visible tests, the hidden cases and their expected values, is derived
from it deterministically, so the feeder, the env-gateway, the eval gate and the expert make
the same task from the same spec in any process. Held-out tasks are those of another seed
(the eval gate's), kept apart from the training tasks by partitions of the task space
(PARTITIONS); each family's names and constants make over a thousand distinct tasks.

A task is written once per process to a folder under a temporary root (removed at exit), in
the layout of a shipped task (libs.domains.coding.tasks), and served by the coding
environment as one:

    files/solution.py          the stub: signature, docstring, `raise NotImplementedError`
    files/test_solution.py     two visible tests (protected: restored before grading)
    reference/solution.py      the solved file (the expert's, and the tests')
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from libs.domains.coding.tasks import CodingTask, HiddenCase, TaskSet
from libs.domains.functions.families import FAMILIES, MAX_DIFFICULTY, Family, Params
from libs.envs.base import SeededTaskSource, TaskSource

ENV_NAME = "functions"
NUM_VISIBLE = 2
NUM_HIDDEN = 6
# A task source of seed s draws only tasks of partition s mod PARTITIONS (a digest of the
# spec), so sources whose seeds differ modulo it never share a task: the eval gate's held-out
# tasks (seed 1_000_003: partition 3) are never trained on (the feeder's seed 0) nor
# demonstrated (the demonstrations' 1234: partition 2); drawn by seed alone, the families
# with the fewest tasks shared many.
PARTITIONS = 8
MAX_CONSTANT = 1000  # bounds of a spec's constants (families draw well inside them)
MAX_CONSTANT_CHARS = 16
TEST_FILE = "test_solution.py"


def parse_spec(spec: Mapping[str, Any]) -> tuple[Family, Params] | None:
    """The family and parameters a spec names, or None when it is not one a family drew:
    an unknown family or function name, missing or extra constants, or another type (a spec
    comes over the bus, and its values end up in files the sandbox runs)."""
    family = FAMILIES.get(spec.get("family"))  # type: ignore[arg-type]
    params = spec.get("params")
    if family is None or not isinstance(params, dict):
        return None
    if params.get("fn") not in family.names or params.get("arg") not in family.args:
        return None
    types = _param_types(family.name)
    if params.keys() != types.keys():
        return None
    for key, kind in types.items():
        if type(params[key]) is not kind or not _bounded(params[key]):
            return None
    return family, dict(params)


@functools.cache
def _param_types(family: str) -> dict[str, type]:
    """The type of each parameter a family draws (from one draw: every draw has the same)."""
    return {key: type(value) for key, value in FAMILIES[family].draw(random.Random(0)).items()}


def _bounded(value: Any) -> bool:
    """A constant no family draws past: a huge count or text would make the expected values
    (computed here) as huge."""
    if isinstance(value, int):
        return abs(value) <= MAX_CONSTANT
    return isinstance(value, str) and len(value) <= MAX_CONSTANT_CHARS


def spec_key(spec: Mapping[str, Any]) -> str:
    """A short digest naming the task of `spec` (its canonical JSON)."""
    text = json.dumps(spec, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def partition(spec: Mapping[str, Any]) -> int:
    """The partition of the task space `spec` is in (0 .. PARTITIONS - 1)."""
    return int(spec_key(spec), 16) % PARTITIONS


def task_inputs(family: Family, params: Params) -> list[Any]:
    """The task's test inputs: the first NUM_VISIBLE visible, the rest hidden."""
    rng = random.Random(f"inputs:{json.dumps(params, sort_keys=True)}:{family.name}")
    return family.inputs(params, rng, NUM_VISIBLE + NUM_HIDDEN)


def visible_tests(family: Family, params: Params, inputs: list[Any]) -> str:
    fn = params["fn"]
    tests = [
        f"def test_example_{i + 1}():\n    assert {fn}({x!r}) == {family.value(params, x)!r}\n"
        for i, x in enumerate(inputs[:NUM_VISIBLE])
    ]
    return f"from solution import {fn}\n\n\n" + "\n\n".join(tests)


@functools.cache
def _root() -> Path:
    """This process's folder of written tasks, removed when it exits."""
    root = Path(tempfile.mkdtemp(prefix="rlpipe-functions-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def generated_task(spec: Mapping[str, Any]) -> CodingTask | None:
    """The coding task of `spec`, written to its folder on first use; None for a spec no
    family drew."""
    parsed = parse_spec(spec)
    if parsed is None:
        return None
    family, params = parsed
    name = f"{family.name}-{spec_key(spec)}"
    inputs = task_inputs(family, params)
    folder = _root() / name
    if not folder.is_dir():
        _write_task(folder, family, params, inputs)
    fn = params["fn"]
    cases = tuple(
        HiddenCase(f"case_{i + 1}", f"{fn}({x!r})", expected=family.value(params, x))
        for i, x in enumerate(inputs[NUM_VISIBLE:])
    )
    return CodingTask(
        name=name,
        prompt=family.prompt(params),
        difficulty=family.difficulty,
        folder=folder,
        setup=f"from solution import {fn}",
        cases=cases,
        protected=(TEST_FILE,),
    )


def _write_task(folder: Path, family: Family, params: Params, inputs: list[Any]) -> None:
    """The task's files, written beside `folder` and renamed into place (episodes of one
    task may open at once)."""
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    (partial / "files").mkdir()
    (partial / "reference").mkdir()
    (partial / "files" / "solution.py").write_text(family.stub(params))
    (partial / "files" / TEST_FILE).write_text(visible_tests(family, params, inputs))
    (partial / "reference" / "solution.py").write_text(family.reference(params))
    try:
        partial.rename(folder)
    except OSError:  # another episode wrote it first: the same bytes
        shutil.rmtree(partial, ignore_errors=True)


class FunctionTasks(SeededTaskSource):
    """Generated tasks in a seeded order. Difficulty d serves the families of difficulty
    <= d (1: one constant, 2: two); 0 serves every family."""

    env: ClassVar[str] = ENV_NAME
    max_difficulty: ClassVar[int] = MAX_DIFFICULTY

    def __init__(self, *, difficulty: int, group_size: int, seed: int) -> None:
        super().__init__(difficulty=difficulty, group_size=group_size, seed=seed)
        self.families = sorted(
            name for name, f in FAMILIES.items() if not difficulty or f.difficulty <= difficulty
        )

    def draw(self, index: int) -> tuple[str, dict[str, Any]]:
        rng = self.rng(index)
        while True:  # 1 in PARTITIONS draws is of this seed's partition
            family = FAMILIES[rng.choice(self.families)]
            params = family.draw(rng)
            spec = {"family": family.name, "params": params}
            if partition(spec) == self.seed % PARTITIONS:
                return family.prompt(params), spec


class GeneratedFunctions(TaskSet):
    """The coding environment's task set for the `functions` domain."""

    def find(self, spec: Mapping[str, Any]) -> CodingTask | None:
        return generated_task(spec)

    def source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        return FunctionTasks(difficulty=difficulty, group_size=group_size, seed=seed)
