"""Datasets as tasks: the rows of a JSONL or parquet file served as single-turn tasks.

    {"prompt": "What is 12+30? Answer with the number.", "answer": "42"}
    {"prompt": "Name the capital of France.", "answer": "Paris", "metadata": {"topic": "geo"}}

    rlpipe demo --dataset problems.jsonl [--dataset-match numeric]
    RLPIPE_ENV_GATEWAY_ENV=dataset RLPIPE_ENV_GATEWAY_DATASET_PATH=problems.parquet \\
        rlpipe run env-gateway

A row has `prompt` (text, required), `answer` (text or number, required) and optional
`metadata` (an object, carried on the task). A parquet file has the same columns (reading it
needs pyarrow: `pip install 'rlpipe[parquet]'`). A malformed row is refused when the file is
read, naming the file, the line (or row) and the field.

The observation is the prompt as is; the policy's answer ends the episode. How an answer is
checked (`match`) travels on the task and is scored by the reward service
(rubric.py): `exact` (case- and whitespace-insensitive), `numeric` (the last number
in the answer equals the expected one), `regex` (the answer, stripped, fully matches the
expected pattern), or `module:function`, a criterion of your own with the signature of
`libs.reward.criteria` functions, `(rollout, task) -> (score in [0, 1], reason)`.

Task `i` is row `order[i % n]` of pass `i // n`, each pass a permutation seeded by (seed,
pass): the same in every process, so a resumed feeder neither repeats nor skips a task.
"""

from __future__ import annotations

import difflib
import importlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.envs.base import Environment, Episode, Opening, StepResult, TaskSource
from libs.malformed_input import describe_malformed
from proto.messages import Task, ToolCall

ENV_NAME = "dataset"
MATCH_KINDS = ("exact", "numeric", "regex")
ROW_FIELDS = ("prompt", "answer", "metadata")


class DatasetError(ValueError):
    """A dataset file that cannot be served; the message names the file, line and field."""


@dataclass(frozen=True)
class DatasetRow:
    """One task of the file: what the policy sees and what its answer is checked against."""

    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class DatasetConfig(BaseModel):
    """Which file, and how answers are checked (env-gateway's `dataset_*` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path = Field(description="JSONL (.jsonl, .json) or parquet (.parquet) file of rows")
    match: str = Field(
        "exact", description="exact, numeric, regex, or module:function (a criterion)"
    )
    max_tokens: int = Field(64, ge=1, description="Longest answer, in tokens")

    @field_validator("match")
    @classmethod
    def _known_match(cls, value: str) -> str:
        return check_match(value)


def check_match(value: str) -> str:
    """`value` if it names an answer check (a function path that imports); else ValueError."""
    if value not in MATCH_KINDS and ":" not in value:
        raise ValueError(
            f"match {value!r}: use {', '.join(MATCH_KINDS)} or module:function "
            "(a criterion (rollout, task) -> (score, reason))"
        )
    if ":" in value:
        import_criterion(value)
    return value


def import_criterion(path: str) -> Any:
    """The function `module:function` names; DatasetError saying what is missing."""
    module_name, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise DatasetError(f"match {path!r}: cannot import it ({exc})") from exc
    if not callable(function):
        raise DatasetError(f"match {path!r}: {name} is not a function")
    return function


def load_rows(path: Path) -> list[DatasetRow]:
    """Every row of the JSONL or parquet file at `path`; DatasetError on the first bad one."""
    if not path.is_file():
        raise DatasetError(f"dataset {path}: no such file")
    if path.suffix == ".parquet":
        records = _parquet_records(path)
    elif path.suffix in (".jsonl", ".json"):
        records = _jsonl_records(path)
    else:
        raise DatasetError(f"dataset {path}: expected a .jsonl or .parquet file")
    rows = [parse_row(record, f"{path}: {where}") for where, record in records]
    if not rows:
        raise DatasetError(f"dataset {path}: no rows")
    return rows


def _jsonl_records(path: Path) -> list[tuple[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"dataset {path}: line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except RecursionError as exc:
            raise DatasetError(
                f"dataset {path}: line {number}: not valid JSON ({describe_malformed(exc)})"
            ) from None
    return records


def _parquet_records(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DatasetError(
            f"dataset {path}: reading parquet needs pyarrow: pip install 'rlpipe[parquet]' "
            "(or convert the file to JSONL)"
        ) from None
    table = parquet.read_table(path)
    return [(f"row {index + 1}", record) for index, record in enumerate(table.to_pylist())]


def parse_row(record: Any, where: str) -> DatasetRow:
    """A row from one decoded record; DatasetError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DatasetError(f"dataset {where}: expected an object with prompt and answer")
    unknown = sorted(set(record) - set(ROW_FIELDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], ROW_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (fields: {', '.join(ROW_FIELDS)})"
        raise DatasetError(f"dataset {where}: unknown field {unknown[0]!r}{hint}")
    prompt, answer = record.get("prompt"), record.get("answer")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(
            f"dataset {where}: field 'prompt' {_problem(prompt, 'a non-empty string')}"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "":
        raise DatasetError(
            f"dataset {where}: field 'answer' {_problem(answer, 'text or a number')}"
        )
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DatasetError(f"dataset {where}: field 'metadata' {_problem(metadata, 'an object')}")
    return DatasetRow(prompt, str(answer), metadata)


def _problem(value: Any, wanted: str) -> str:
    if value is None:
        return "is missing"
    return f"must be {wanted} (got {type(value).__name__} {str(value)[:40]!r})"


class DatasetTasks(TaskSource):
    """The file's rows as tasks, each pass over them in its own seeded order."""

    def __init__(
        self, rows: Sequence[DatasetRow], config: DatasetConfig, group_size: int, seed: int
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.rows, self.config = list(rows), config
        self.group_size, self.seed = group_size, seed
        self._order: tuple[int, list[int]] = (-1, [])  # the latest pass's order, reused

    def order(self, epoch: int) -> list[int]:
        """Row indices of pass `epoch`, a permutation seeded by (seed, epoch)."""
        if self._order[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{ENV_NAME}:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        epoch, position = divmod(index, len(self.rows))
        row_index = self.order(epoch)[position]
        row = self.rows[row_index]
        spec = {
            "answer": row.answer,
            "match": self.config.match,
            "row": row_index,
            "max_tokens": self.config.max_tokens,
            "metadata": row.metadata,
        }
        return Task(
            task_id=f"{ENV_NAME}-s{self.seed}-{index}",
            env=ENV_NAME,
            prompt=row.prompt,
            group_size=self.group_size,
            spec=spec,
        )


class DatasetEpisode(Episode):
    """One answer, then done; the reward service checks it against the task's answer."""

    async def step(self, action: str, tool_calls: Sequence[ToolCall] = ()) -> StepResult:
        return StepResult(done=True)


class DatasetEnv(Environment):
    """Serves tasks of a dataset file: the prompt is the observation; one answer ends it.

    Without a `config` it opens episodes on dataset tasks published by anyone, but has no
    tasks of its own to feed (env-gateway gives it the file of `dataset_path`)."""

    name: ClassVar[str] = ENV_NAME

    def __init__(self, config: DatasetConfig | None = None) -> None:
        self.config = config
        self.rows = load_rows(config.path) if config is not None else []

    async def reset(self, task: Task) -> tuple[Episode, Opening]:
        if not isinstance(task.spec.get("answer"), str):
            raise ValueError(f"dataset task {task.task_id} has no text answer in spec['answer']")
        max_tokens = int(
            task.spec.get("max_tokens", DatasetConfig.model_fields["max_tokens"].default)
        )
        return DatasetEpisode(), Opening(observation=task.prompt, max_tokens=max_tokens)

    def task_source(self, *, difficulty: int, group_size: int, seed: int) -> TaskSource:
        if self.config is None:
            raise ValueError(
                "environment 'dataset' serves the rows of a file: set "
                "RLPIPE_ENV_GATEWAY_DATASET_PATH (or run rlpipe demo --dataset FILE)"
            )
        return DatasetTasks(self.rows, self.config, group_size, seed)
