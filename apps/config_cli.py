"""`rlpipe config`: every setting of a service, where its value came from, and a check of all.

    rlpipe config show trainer                     # field, type, default, value, source
    rlpipe config show trainer --json              # the same rows as JSON lines
    rlpipe config show trainer --set trainer.learning_rate=1e-4
    rlpipe config check                            # every service's variables and TOML
    rlpipe config reference > docs/configuration.md  # every field, type, default, doc

A value comes from, highest first: `--set` (carried to services as RLPIPE_SET), the
service's variable (`RLPIPE_TRAINER_LEARNING_RATE`, or a shared one such as
`RLPIPE_NATS_URL`), the `[<service>]` table of the TOML file named by RLPIPE_CONFIG, the
default. `check` loads every service's settings as the service would (libs.settings) and
also refuses `RLPIPE_*` variables that no service reads and TOML tables that name no service,
each with the nearest name. Exit 0: all good; 2: one `error:` line per problem.

The services' settings classes are passed in (`settings_classes`): libs never import services.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from apps.config_reference import reference, type_name
from apps.launcher.recipe import WARM_START_TABLE
from libs.settings import (
    CONFIG_VARIABLE,
    OVERRIDES_VARIABLE,
    SHARED_FALLBACKS,
    ServiceSettings,
    SettingsError,
    is_secret,
    load_settings,
    merge_overrides,
    nested_fields,
    setting_source,
    toml_document,
    variable_names,
)

SettingsClasses = Mapping[str, Callable[[], type[ServiceSettings]]]

# RLPIPE_* variables that are not service fields: the config file, the overrides, and what
# compose.yaml, the Dockerfile and the launcher read.
GLOBAL_VARIABLES = frozenset(
    {
        CONFIG_VARIABLE,
        OVERRIDES_VARIABLE,
        *SHARED_FALLBACKS.values(),
        "RLPIPE_CACHE_DIR",
        "RLPIPE_EXTRAS",
        "RLPIPE_GPU_EXTRAS",
        "RLPIPE_TORCH_CUDA_INDEX_URL",
        "RLPIPE_NATS_REPLICAS",
        "RLPIPE_NATS_SERVICES_PASSWORD",
        "RLPIPE_NATS_FEEDBACK_API_PASSWORD",
        "RLPIPE_NATS_LEAF_PASSWORD",
        "RLPIPE_GRAFANA_ADMIN_PASSWORD",
        # compose's choice of NATS server configuration (nats-secure.conf or cluster.conf)
        "RLPIPE_NATS_CONFIG",
        # Domain folders beyond the built-ins (libs.domains.registry, which imports torch).
        "RLPIPE_DOMAIN_PATHS",
    }
)
# Compose's published ports (RLPIPE_NATS_HOST_PORT, ...) and the coding environment's own
# settings (libs.domains.coding, RLPIPE_ENV_CODING_*).
GLOBAL_PATTERN = re.compile(r"RLPIPE_[A-Z0-9_]+_HOST_PORT|RLPIPE_ENV_CODING_[A-Z0-9_]+")


@dataclass(frozen=True)
class FieldRow:
    """One setting as `config show` prints it."""

    field: str
    type: str
    default: Any
    value: Any
    source: str
    description: str


def add_config_parser(commands: argparse._SubParsersAction, services: tuple[str, ...]) -> None:
    """`rlpipe config show SERVICE [--json] [--set ...]` and `rlpipe config check [--set ...]`."""
    config = commands.add_parser("config", help="show or check the services' settings")
    actions = config.add_subparsers(dest="config_command", required=True)
    show = actions.add_parser("show", help="every field of a service and where its value is from")
    show.add_argument("service", choices=services)
    show.add_argument("--json", action="store_true", help="one JSON object per field")
    check = actions.add_parser("check", help="validate every service's variables and TOML")
    page = actions.add_parser("reference", help="print the configuration reference (Markdown)")
    page.set_defaults(overrides=[])
    for parser in (show, check):
        add_set_argument(parser)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """`--set SERVICE.FIELD=VALUE`, repeatable (for `run`, `demo` and `config`)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SERVICE.FIELD=VALUE",
        help="override a setting, e.g. --set trainer.learning_rate=1e-4 (repeatable; "
        "nested fields with dots: trainer.policy.path=DIR)",
    )


def apply_overrides(texts: list[str], classes: SettingsClasses) -> None:
    """Check `texts` against the services' fields and put them in RLPIPE_SET, where every
    service started from here (or by the demo) reads them; SettingsError names a typo."""
    if not texts:
        return
    existing = json.loads(os.environ.get(OVERRIDES_VARIABLE) or "{}")
    tables = merge_overrides(texts, existing)
    problems = list(override_problems(tables, classes))
    if problems:
        raise SettingsError("\n".join(problems))
    os.environ[OVERRIDES_VARIABLE] = json.dumps(tables)


def check_services(classes: SettingsClasses, services: Iterable[str]) -> None:
    """Load the settings of `services` as each would at its start (variables, TOML, --set):
    `rlpipe demo` refuses a mistake before starting anything; SettingsError lists them all."""
    problems: list[str] = []
    loaded: dict[str, Any] = {}
    for service in (name for name in services if name in classes):  # others: refused later
        try:
            loaded[service] = load_settings(classes[service]())
        except SettingsError as exc:
            problems += str(exc).splitlines()
    problems += combination_problems(loaded)
    if problems:
        raise SettingsError("\n".join(problems))


def combination_problems(loaded: Mapping[str, Any]) -> list[str]:
    """Settings each valid alone that cannot run together in one run."""
    trainer, gateway = loaded.get("trainer"), loaded.get("env-gateway")
    if trainer is None or gateway is None:
        return []
    if trainer.zero_variance_groups == "skip" and gateway.feeder.mode == "sync":
        # The sync feeder publishes batch_groups tasks a version: a skipped group's
        # replacement is never fed, and the step waits for ever.
        return [
            "trainer.zero_variance_groups=skip needs env-gateway feeder.mode async: the sync "
            "feeder publishes only batch_groups tasks a version, none for skipped groups"
        ]
    return []


def override_problems(tables: dict[str, Any], classes: SettingsClasses) -> Iterator[str]:
    for service, table in tables.items():
        if service not in classes:
            yield f"--set {service}.*: no service {service!r}{closest(service, list(classes))}"
            continue
        cls = classes[service]()
        known = dotted_fields(cls)
        for name, value in table.items():
            nested = name in nested_fields(cls) and isinstance(value, dict)
            for field in [f"{name}.{sub}" for sub in value] if nested else [name]:
                if field not in known:
                    yield f"--set {service}.{field}: no such field{closest(field, known)}"


def dotted_fields(cls: type[ServiceSettings]) -> list[str]:
    """Every field of `cls`, nested ones also as `policy.path`."""
    names = list(cls.model_fields)
    for name, model in nested_fields(cls).items():
        names += [f"{name}.{sub}" for sub in model.model_fields]
    return names


def closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def field_rows(cls: type[ServiceSettings], settings: ServiceSettings) -> list[FieldRow]:
    """Every field of `cls`, nested fields as `policy.path`, with `settings`' values."""
    rows = []
    for name, info in cls.model_fields.items():
        value = getattr(settings, name)
        model = nested_fields(cls).get(name)
        if model is None:
            rows.append(_row(cls, name, info, value))
            continue
        for sub, sub_info in model.model_fields.items():
            rows.append(_row(cls, f"{name}.{sub}", sub_info, getattr(value, sub)))
    return rows


def _row(cls: type[ServiceSettings], dotted: str, info: FieldInfo, value: Any) -> FieldRow:
    return FieldRow(
        field=dotted,
        type=type_name(info.annotation),
        default=_plain(_default(info)),
        value=_plain(value),
        source=setting_source(cls, dotted),
        description=info.description or "",
    )


def _default(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None


def _plain(value: Any) -> Any:
    """JSON-ready form of a setting's value (paths and models as text and dicts)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str, dict)):
        return value
    return str(value)


def show(service: str, classes: SettingsClasses, as_json: bool) -> int:
    cls = classes[service]()
    settings = load_settings(cls)
    rows = field_rows(cls, settings)
    if as_json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    table = [("field", "type", "default", "value", "source")]
    for row in rows:
        value = "***" if is_secret(row.field) and row.value else _text(row.value)
        table.append((row.field, row.type, _text(row.default), value, row.source))
    widths = [min(max(len(r[i]) for r in table), limit) for i, limit in enumerate(WIDTHS)]
    for cells in table:
        shown = [_clip(c, w).ljust(w) for c, w in zip(cells, widths, strict=False)]
        print("  ".join([*shown, cells[4]]))
    return 0


# Widest field, type, default and value columns of the table; longer cells are cut with "…".
WIDTHS = (40, 28, 24, 24)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def check(classes: SettingsClasses) -> int:
    """Load every service's settings; refuse variables and tables nothing reads."""
    problems: list[str] = []
    loaded = {}
    for service, load in classes.items():
        cls = load()
        loaded[service] = cls
        try:
            load_settings(cls)
        except SettingsError as exc:
            problems += str(exc).splitlines()
    problems += stray_variables(loaded, os.environ)
    problems += stray_tables(loaded)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 2
    source = os.environ.get(CONFIG_VARIABLE)
    print(f"ok: {len(loaded)} services" + (f", TOML {source}" if source else ""))
    return 0


def stray_variables(
    classes: Mapping[str, type[ServiceSettings]], environ: Mapping[str, str]
) -> list[str]:
    """`RLPIPE_*` variables outside every service's prefix and not a known global."""
    prefixes = [str(cls.model_config.get("env_prefix", "")).upper() for cls in classes.values()]
    known = sorted(GLOBAL_VARIABLES | {n for c in classes.values() for n in variable_names(c)})
    problems = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith("RLPIPE_") or upper in GLOBAL_VARIABLES:
            continue
        if any(upper.startswith(p) for p in prefixes) or GLOBAL_PATTERN.fullmatch(upper):
            continue  # a service's own variables are checked when it loads
        problems.append(f"unknown variable {variable}: no service reads it{closest(upper, known)}")
    return problems


def stray_tables(classes: Mapping[str, type[ServiceSettings]]) -> list[str]:
    """Tables of the TOML file that name no service (a recipe's [warm_start] is the demo's)."""
    tables = {service.replace("-", "_") for service in classes} | {WARM_START_TABLE}
    return [
        f"unknown TOML table [{name}] in {os.environ.get(CONFIG_VARIABLE)}"
        f"{closest(name, sorted(tables))}"
        for name in toml_document()
        if name not in tables
    ]


def run(args: argparse.Namespace, classes: SettingsClasses) -> int:
    try:
        apply_overrides(args.overrides, classes)
        if args.config_command == "show":
            return show(args.service, classes, args.json)
        if args.config_command == "reference":
            print(reference(classes), end="")
            return 0
        return check(classes)
    except SettingsError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
