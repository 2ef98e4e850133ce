"""`rlpipe config reference`: the configuration reference, generated from the settings classes.

    rlpipe config reference > docs/configuration.md

Every service's fields with their type, default and one-line description, nested configs
(`policy.path`, `weights.decode_threads`) as dotted names. tests/test_config.py checks that
the committed docs/configuration.md is what this prints.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from libs.settings import CONFIG_VARIABLE, OVERRIDES_VARIABLE, SHARED_FALLBACKS, ServiceSettings

HEADER = f"""# Configuration reference

Generated from the services' settings classes by `rlpipe config reference >
docs/configuration.md`; do not edit by hand (tests/test_config.py checks it is current).

A service reads each field, highest first, from: a command-line override (`rlpipe run|demo
--set trainer.learning_rate=1e-4`, carried as `{OVERRIDES_VARIABLE}`), its variable
(`RLPIPE_<SERVICE>_<FIELD>`, e.g. `RLPIPE_TRAINER_LEARNING_RATE`), the `[<service>]` table of
the TOML file named by `{CONFIG_VARIABLE}` (a recipe), the default below. A nested field
`weights.decode_threads` is `RLPIPE_ROLLOUT_WORKER_WEIGHTS_DECODE_THREADS`, the key
`decode_threads` of the TOML table `[rollout_worker.weights]`, or `--set
rollout-worker.weights.decode_threads=4`. `rlpipe config show SERVICE` prints the values in
effect and where each came from; `rlpipe config check` refuses unknown names with the
nearest one. Fields shared by a whole deployment also read a shared variable:

{chr(10).join(f"- `{v}`" for v in SHARED_FALLBACKS.values())}
"""


def reference(classes: Mapping[str, Callable[[], type[ServiceSettings]]]) -> str:
    """The whole page: the header, then one table per service."""
    sections = [HEADER]
    for service, load in classes.items():
        sections.append(service_section(service, load()))
    return "\n".join(sections)


def service_section(service: str, cls: type[ServiceSettings]) -> str:
    """`## service`, where it reads from, and a table of its fields."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    table = service.replace("-", "_")
    lines = [
        f"## {service}",
        "",
        f"Variables `{prefix}<FIELD>`, TOML table `[{table}]`.",
        "",
        "| field | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    lines += [_row(name, info) for name, info in fields_of(cls)]
    return "\n".join(lines) + "\n"


def fields_of(cls: type[BaseModel], parent: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf field of `cls` as (dotted name, info); a nested config's fields follow it."""
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from fields_of(annotation, f"{parent}{name}.")
        else:
            yield f"{parent}{name}", info


def _row(name: str, info: FieldInfo) -> str:
    description = " ".join((info.description or "").split())
    cells = [f"`{name}`", _code(type_name(info.annotation)), _code(default_text(info))]
    return "| " + " | ".join([*cells, description.replace("|", "\\|")]) + " |"


def type_name(annotation: Any) -> str:
    """`int | None`, `Literal['a', 'b']` -> `'a' | 'b'`, `list[ApiKeyEntry]`, `Path`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """The default as a reader writes it; one computed at start (by the machine) says so."""
    if info.default is not PydanticUndefined:
        return _json(info.default)
    factory = info.default_factory
    if isinstance(factory, type):  # list, dict: their empty value is the same everywhere
        return _json(factory())
    return "computed" if factory is not None else "required"


def _json(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (bool, int, float, str, list, dict)):
        return json.dumps(value)
    return str(value)


def _code(text: str) -> str:
    return f"`{text.replace('|', chr(92) + '|')}`"
