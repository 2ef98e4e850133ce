"""Recipes: how the demo runs one domain, as one TOML file (libs/domains/<name>/recipe.toml).

A recipe holds the services' tables, which the settings loader reads as it reads any
RLPIPE_CONFIG file (libs/settings.py: `[trainer]`, `[rollout_worker]`, ...), and, for a domain
whose policy starts from a warm start, a `[warm_start]` table (WarmStartRecipe: the
demonstrations, the SFT, and in `[warm_start.rl.<service>]` what RL from it changes):

    recipe = load_recipe(Path("libs/domains/calc/recipe.toml"))
    recipe.tables["trainer"]["batch_groups"]        # 2
    recipe.warm_start.steps                         # 1200

The launcher resolves a recipe (the file, the demo's flags, the warm start's policy) into the
run folder's `recipe.toml` and hands that file to every service through RLPIPE_CONFIG;
variables set in the environment and `--set` still win over it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from libs.policy_presets import POLICY_PRESETS
from libs.settings import CONFIG_VARIABLE, toml_document
from proto.services import SERVICES

RECIPE_FILE = "recipe.toml"
WARM_START_TABLE = "warm_start"
# Service tables are named with underscores (`[rollout_worker]`), as libs.settings reads them.
SERVICE_TABLES = tuple(name.replace("-", "_") for name in SERVICES)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file and the table or field."""


class WarmStartRecipe(BaseModel):
    """A recipe's `[warm_start]`: how the policy RL starts from is made (the scripted expert's
    demonstrations, a tokenizer trained on them, SFT of a random-init policy preset) and the
    service tables RL from it changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_tasks: int = Field(gt=0, description="Expert episodes recorded as demonstrations")
    error_rate: float = Field(ge=0, le=1, description="Fraction of the expert's calls that slip")
    steps: int = Field(gt=0, description="SFT steps")
    tokenizer_vocab_size: int = Field(
        1024, gt=258, description="Tokens of the BPE tokenizer trained on the demonstrations"
    )
    batch_size: int = Field(32, gt=0, description="Demonstration segments per SFT step")
    learning_rate: float = Field(3e-3, gt=0, description="SFT learning rate")
    preset: str = Field(
        "tiny",
        description="Policy preset fine-tuned (libs.policy_presets): tiny on a CPU, agent-75m "
        "on a GPU (with a learning_rate of 1e-3 or less)",
    )
    rl: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Service tables applied over the recipe's when RL starts from the warm start",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        """`preset`, when it names a policy preset."""
        if preset not in POLICY_PRESETS:
            raise ValueError(
                f"unknown policy preset {preset!r}; choose one of {sorted(POLICY_PRESETS)}"
            )
        return preset

    def build_settings(self) -> dict[str, Any]:
        """The settings that make the warm start (all but `rl`): what its cache is keyed on."""
        return self.model_dump(exclude={"rl"})


@dataclass(frozen=True)
class WarmStart:
    """The warm start of a run: domain `env`'s policy made as `recipe` says."""

    env: str
    recipe: WarmStartRecipe


@dataclass(frozen=True)
class Recipe:
    """A recipe read from its file: the services' tables and its warm start, if any."""

    tables: Mapping[str, Any] = field(default_factory=dict)
    warm_start: WarmStartRecipe | None = None
    path: Path | None = None

    @property
    def env(self) -> str | None:
        """The domain the recipe trains: its `[env_gateway] env`."""
        env = self.tables.get("env_gateway", {}).get("env")
        return str(env) if env is not None else None


def load_recipe(path: Path) -> Recipe:
    """The recipe in `path`; RecipeError naming the file and what is wrong (a table that
    names no service, a mistyped `[warm_start]` field). The service tables' fields are
    checked by the services' settings (apps.config_cli.check_services)."""
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"recipe {path}: cannot read TOML ({exc})") from exc
    warm = document.pop(WARM_START_TABLE, None)
    problems = [f"recipe {path}: {p}" for p in unknown_tables(document, "[{}]")]
    warm_start = None
    if warm is not None:
        try:
            warm_start = WarmStartRecipe.model_validate(warm)
        except ValidationError as exc:
            problems += [f"recipe {path}: {warm_start_problem(e)}" for e in exc.errors()]
        else:
            where = f"[{WARM_START_TABLE}.rl.{{}}]"
            problems += [f"recipe {path}: {p}" for p in unknown_tables(warm_start.rl, where)]
    if problems:
        raise RecipeError("\n".join(problems))
    return Recipe(document, warm_start, path)


def unknown_tables(document: Mapping[str, Any], where: str) -> list[str]:
    """A problem for each top-level name of `document` that is not a service table."""
    allowed = ", ".join(SERVICE_TABLES)
    return [
        f"unknown table {where.format(name)}: a recipe's tables are {allowed} and "
        f"{WARM_START_TABLE}"
        for name, value in document.items()
        if name not in SERVICE_TABLES or not isinstance(value, dict)
    ]


def warm_start_problem(error: Any) -> str:
    """One line for a pydantic error of `[warm_start]`: the field and what is wrong."""
    location = ".".join(str(part) for part in (WARM_START_TABLE, *error["loc"]))
    if error["type"] == "extra_forbidden":
        known = ", ".join(name for name in WarmStartRecipe.model_fields)
        return f"unknown field {location} (the fields of [{WARM_START_TABLE}]: {known})"
    return f"{location}: {error['msg']}"


def merge_tables(*documents: Mapping[str, Any]) -> dict[str, Any]:
    """`documents` merged table by table, later values winning."""
    merged: dict[str, Any] = {}
    for document in documents:
        for key, value in document.items():
            below = merged.get(key)
            if isinstance(value, Mapping) and isinstance(below, Mapping):
                merged[key] = merge_tables(below, value)
            elif isinstance(value, Mapping):
                merged[key] = merge_tables(value)
            else:
                merged[key] = value
    return merged


def run_recipe(tables: Mapping[str, Any]) -> dict[str, Any]:
    """The tables a run's services read: `tables`, a file named by RLPIPE_CONFIG over them."""
    return merge_tables(tables, toml_document())


@contextlib.contextmanager
def recipe_in_use(tables: Mapping[str, Any]) -> Iterator[None]:
    """Inside the block, RLPIPE_CONFIG names a file of the run's recipe (`run_recipe(tables)`,
    in a folder of its own: a run refused leaves no run folder), so that a service's settings
    load as that service will load them: `rlpipe demo` checks them all before anything
    starts."""
    resolved, before = run_recipe(tables), os.environ.get(CONFIG_VARIABLE)
    with tempfile.TemporaryDirectory(prefix="rlpipe-recipe-") as folder:
        os.environ[CONFIG_VARIABLE] = str(write_recipe(resolved, Path(folder)))
        try:
            yield
        finally:
            os.environ.pop(CONFIG_VARIABLE)
            if before is not None:
                os.environ[CONFIG_VARIABLE] = before


def write_recipe(tables: Mapping[str, Any], run_dir: Path) -> Path:
    """`tables` written as `<run_dir>/recipe.toml`, the file the run's services read."""
    path = run_dir / RECIPE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(toml_text(tables))
    path.with_suffix(".tmp").replace(path)
    return path


def toml_text(document: Mapping[str, Any], prefix: str = "") -> str:
    """`document` as TOML: a table's values under its `[header]`, then its nested tables."""
    values = [
        f"{toml_key(key)} = {toml_value(value)}"
        for key, value in document.items()
        if not isinstance(value, Mapping)
    ]
    blocks = []
    if values or (prefix and not document):
        blocks.append("\n".join([f"[{prefix}]", *values] if prefix else values))
    for key, value in document.items():
        if isinstance(value, Mapping):
            name = f"{prefix}.{toml_key(key)}" if prefix else toml_key(key)
            blocks.append(toml_text(value, name).rstrip("\n"))
    return "\n\n".join(blocks) + "\n"


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def toml_value(value: Any) -> str:
    """A TOML value: a string, bool, number, list, inline table or path."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        # A JSON string is a TOML basic string but for DEL, which TOML wants escaped.
        return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        items = (f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"a recipe value must be text, a number, a bool or a list: {value!r}")
