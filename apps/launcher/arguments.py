"""The flags of `rlpipe demo` and the run they ask for (apps.launcher.run.LaunchOptions).

The run's recipe is one TOML file (apps.launcher.recipe): `--recipe PATH`, else the recipe of
the domain `--env` names (libs/domains/<name>/recipe.toml), else arith's. The flags that
choose what is trained (`--dataset`) are added to its tables; the run limits stay flags.

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    options = options_from_args(parser.parse_args(["--env", "calc"]))
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from apps.launcher.recipe import Recipe, RecipeError, WarmStart, load_recipe, merge_tables
from apps.launcher.run import LaunchOptions, default_run_dir
from libs.trainer.launch import trainer_command
from proto.services import SERVICES

DEFAULT_DOMAIN = "arith"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demo` flags: what to train (a recipe), bounds for scripted runs, where it runs."""
    add_recipe_arguments(parser)
    parser.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="stop this many seconds after the services start (default: run until Ctrl-C)",
    )
    parser.add_argument(
        "--max-trainer-steps",
        type=int,
        default=None,
        help="stop once the trainer reports this step",
    )
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="run folder (default: runs/<UTC timestamp>/)"
    )
    parser.add_argument(
        "--services",
        default=",".join(SERVICES),
        help="comma-separated services to start (default: all six)",
    )
    parser.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run the bus as a local JetStream cluster of N >= 3 nodes, every stream and KV "
        "bucket on 3 of them (default: 1, one nats-server)",
    )
    parser.add_argument(
        "--open-bus",
        action="store_true",
        help="run the bus without users (default: a user per role from proto/permissions.py, "
        "passwords made for the run, each service its own)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the bus over TLS with client certificates, from a CA made for the run "
        "(run folder tls/); clients without a certificate are refused",
    )
    add_layout_arguments(parser)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say how many processes of the trainer and the workers run, and where."""
    parser.add_argument(
        "--rollout-workers",
        type=int,
        default=1,
        metavar="N",
        help="run N rollout-worker processes with the same settings (on a GPU: the same card, "
        "each its own engine and copy of the weights) (default: 1)",
    )
    parser.add_argument(
        "--worker-devices",
        default="",
        metavar="DEV,...",
        help="one rollout-worker per device, each on its own (e.g. cuda:2,cuda:3 beside "
        "--trainer-ranks 2 on cuda:0 and cuda:1); overrides the recipe's worker device",
    )
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        metavar="N",
        help="run the trainer sharded over N processes with torchrun (FSDP2; gloo on CPU, "
        "NCCL on GPU; libs/trainer/ranks.py) (default: 1)",
    )


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the run's recipe and its warm start."""
    parser.add_argument(
        "--env",
        default=None,
        help="domain to train, with its recipe (libs/domains/<name>/recipe.toml): arith "
        "(default, learns in minutes on a CPU), calc (multi-turn calculator tools), recall "
        "(long episodes that need self-summarization), coding (Python projects in sandboxes) or "
        "functions (generated Python functions in sandboxes)",
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=None,
        metavar="FILE",
        help="run this recipe file instead of a domain's (e.g. libs/domains/arith/gpu.toml)",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        default=None,
        metavar="FILE",
        help="train on a JSONL or parquet file of {prompt, answer, metadata} rows "
        "(libs/domains/dataset/) instead of a built-in environment",
    )
    parser.add_argument(
        "--dataset-match",
        default="exact",
        help="how answers to --dataset rows are checked: exact, numeric, regex or "
        "module:function (default: exact)",
    )
    parser.add_argument(
        "--no-warm-start",
        action="store_true",
        help="start from the random-init policy instead of the recipe's warm start (SFT)",
    )
    parser.add_argument(
        "--warm-start-dir",
        type=Path,
        default=None,
        help="cache of warm-start policies (default: $RLPIPE_CACHE_DIR/warm_start or "
        "~/.cache/rlpipe/warm_start)",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The run the flags ask for; ValueError (a RecipeError naming the file and field, a
    DatasetError naming the line and field of a bad row) before anything starts."""
    services = tuple(name.strip() for name in args.services.split(",") if name.strip())
    recipe = demo_recipe(args)
    warm = None if args.no_warm_start else warm_start_of(recipe)
    commands = {}
    if args.trainer_ranks != 1:
        commands["trainer"] = trainer_command(args.trainer_ranks)
    return LaunchOptions(
        run_dir=args.run_dir or default_run_dir(),
        duration_s=args.duration_s,
        max_trainer_steps=args.max_trainer_steps,
        services=services,
        recipe=merge_tables(recipe.tables, warm.recipe.rl if warm else {}),
        warm_start=warm,
        warm_start_root=args.warm_start_dir,
        nats_cluster=args.nats_cluster,
        rollout_workers=args.rollout_workers,
        worker_devices=tuple(d.strip() for d in args.worker_devices.split(",") if d.strip()),
        commands=commands,
        secure_bus=not args.open_bus,
        tls=args.tls,
    )


def warm_start_of(recipe: Recipe) -> WarmStart | None:
    """The warm start `recipe` asks for; RecipeError when its domain has no scripted expert
    to record demonstrations with."""
    if recipe.warm_start is None:
        return None
    from libs.experts.demos import expert_domains

    if recipe.env not in expert_domains():
        raise RecipeError(
            f"recipe {recipe.path}: a [warm_start] needs a domain with a scripted expert in "
            f"[env_gateway] env ({', '.join(expert_domains())}; this one: {recipe.env})"
        )
    return WarmStart(str(recipe.env), recipe.warm_start)


def demo_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe the flags name, with `--dataset`'s file in its tables."""
    if args.env and (args.recipe or args.dataset):
        other = "--recipe" if args.recipe else "--dataset"
        raise ValueError(f"--env and {other}: choose one (a recipe names its env itself)")
    name = "dataset" if args.dataset else args.env or DEFAULT_DOMAIN
    recipe = load_recipe(args.recipe or domain_recipe(name))
    if not args.dataset:
        return recipe
    tables = merge_tables(recipe.tables, dataset_tables(args))
    return Recipe(tables, recipe.warm_start, recipe.path)


def domain_recipe(name: str) -> Path:
    """The recipe file of domain `name` (RecipeError when it has none)."""
    # Imported here: the registry imports every domain, which `rlpipe --help` need not pay.
    from libs.domains.registry import UnknownDomainError, domain

    try:
        path = domain(name).recipe_path
    except UnknownDomainError as exc:
        raise RecipeError(f"--env: {exc}") from None
    if not path.is_file():
        raise RecipeError(f"domain {name!r} has no recipe ({path}): pass --recipe FILE")
    return path


def dataset_tables(args: argparse.Namespace) -> dict[str, Any]:
    """The env-gateway fields that make it feed the rows of `--dataset` (read here first, so
    a bad row stops the demo before anything starts)."""
    from libs.domains.dataset.env import DatasetConfig, load_rows

    path = args.dataset.resolve()
    load_rows(DatasetConfig(path=path, match=args.dataset_match).path)
    return {"env_gateway": {"dataset_path": str(path), "dataset_match": args.dataset_match}}
