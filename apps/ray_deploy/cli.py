"""`rlpipe ray up|status|scale|down`: the services placed, restarted and scaled by Ray.

    pip install 'rlpipe[ray]'
    ray start --head                                   # or an existing cluster
    rlpipe ray up --address auto --nats-url nats://n1:4222,nats://n2:4222,nats://n3:4222 \\
        --nats-replicas 3 --gpus trainer=1 --gpus rollout-worker=1 --max-workers 8
    rlpipe ray status --address auto                   # actors, nodes, health, backlog
    rlpipe ray scale --address auto --min 2 --max 16   # bounds of the rollout tier
    rlpipe ray down --address auto                     # workers drain first, then the rest

Without `--address`, `up` starts a local Ray cluster (and, without `--nats-url`, a local
nats-server in the run folder), stays in the foreground printing status, and takes
everything down on Ctrl-C or at `--duration-s`. With `--address` the deployment is detached:
it outlives the command, and `status`, `scale` and `down` reach it by name.
`--recipe FILE` hands a recipe (libs/domains/<name>/recipe.toml) to every service through
RLPIPE_CONFIG, at the same path on each node.
Ray is an optional extra: nothing outside apps/ray_deploy imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from apps.launcher.recipe import RecipeError, load_recipe
from apps.ray_deploy.plan import (
    WORKER,
    DeploymentPlan,
    ScalePolicy,
    build_plan,
    parse_assignments,
)
from libs.settings import CONFIG_VARIABLE
from proto.services import SERVICES


def add_ray_parser(commands: Any) -> None:
    ray = commands.add_parser("ray", help="place, scale and watch the services on a Ray cluster")
    actions = ray.add_subparsers(dest="ray_command", required=True)
    up = actions.add_parser("up", help="deploy every service as a Ray actor")
    _address(up)
    up.add_argument("--nats-url", default=None, help="the bus (default: a local nats-server)")
    up.add_argument("--nats-replicas", type=int, default=None, help="1, or 3 on a NATS cluster")
    up.add_argument("--run-dir", type=Path, default=None, help="shared run folder on each node")
    up.add_argument("--services", default=",".join(SERVICES), help="comma-separated subset")
    up.add_argument("--min-workers", type=int, default=1)
    up.add_argument("--max-workers", type=int, default=4)
    up.add_argument("--tasks-per-worker", type=int, default=64, help="backlog per worker")
    up.add_argument("--poll-s", type=float, default=2.0, help="seconds between backlog polls")
    up.add_argument("--gpus", action="append", metavar="SERVICE=N", help="GPUs per service")
    up.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        metavar="N",
        help="the trainer sharded over N processes on one node (torchrun in its actor; its "
        "--gpus and --cpus are per rank)",
    )
    up.add_argument("--cpus", action="append", metavar="SERVICE=N", help="CPUs per service")
    up.add_argument("--env", action="append", metavar="NAME=VALUE", help="for every service")
    up.add_argument(
        "--recipe", type=Path, default=None, metavar="FILE", help="settings every service reads"
    )
    up.add_argument("--duration-s", type=float, default=None, help="local: stop after this")
    status = actions.add_parser("status", help="the deployment's actors, health and backlog")
    _address(status)
    status.add_argument("--json", action="store_true", help="one JSON document")
    scale = actions.add_parser("scale", help="set the rollout-workers' bounds")
    _address(scale)
    scale.add_argument("--min", type=int, required=True, dest="min_workers")
    scale.add_argument("--max", type=int, required=True, dest="max_workers")
    down = actions.add_parser("down", help="drain and remove every service actor")
    _address(down)


def _address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster (`auto`, host:port, ray://...; default $RAY_ADDRESS); `up` without "
        "it starts a local cluster",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401  # the optional extra
    except ImportError:
        print("error: Ray is not installed; pip install 'rlpipe[ray]'", file=sys.stderr)
        return 2
    handlers = {"up": on_up, "status": on_status, "scale": on_scale, "down": on_down}
    try:
        return handlers[args.ray_command](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _connect(address: str | None, num_cpus: float | None = None) -> None:
    """Join the cluster at `address`, or start a local one with `num_cpus` logical CPUs."""
    import ray

    local = address is None
    ray.init(
        address=address,
        namespace="rlpipe",
        logging_level=logging.WARNING,
        log_to_driver=False,
        include_dashboard=False if local else None,
        num_cpus=math.ceil(num_cpus) if local and num_cpus else None,
    )


def local_cpus(plan: DeploymentPlan) -> float:
    """Logical CPUs a local cluster gets: every request at the most workers, or this
    machine's cores if more (the services share them, as in `rlpipe demo`)."""
    fixed = sum(s.num_cpus for s in plan.services if s.name != WORKER)
    workers = sum(s.num_cpus for s in plan.services if s.name == WORKER) * plan.scale.max_workers
    return max(float(os.cpu_count() or 1), fixed + workers)


def recipe_variables(path: Path | None) -> dict[str, str]:
    """RLPIPE_CONFIG naming the recipe `path` (checked first); a recipe whose policy starts
    from a warm start is refused: `rlpipe demo` builds that, Ray does not."""
    if path is None:
        return {}
    recipe = load_recipe(path)
    if recipe.warm_start is not None:
        raise RecipeError(
            f"recipe {path}: its [warm_start] is built by `rlpipe demo`; on Ray, use a recipe "
            "whose [trainer.policy] and [rollout_worker.policy] name the model folder"
        )
    return {CONFIG_VARIABLE: str(path.resolve())}


def on_up(args: argparse.Namespace) -> int:
    from apps.launcher.weight_keys import run_signing_environment
    from apps.ray_deploy.controller import deploy

    run_dir = (args.run_dir or Path("runs") / time.strftime("ray-%Y%m%dT%H%M%SZ")).resolve()
    nats = None
    if args.nats_url is None:
        if args.address:
            raise ValueError("--nats-url is needed with --address: the bus every node reaches")
        nats = _local_nats(run_dir)
    nats_url = args.nats_url or nats.url  # type: ignore[union-attr]
    plan = build_plan(
        nats_url,
        str(run_dir),
        services=tuple(s.strip() for s in args.services.split(",") if s.strip()),
        cpus={k: float(v) for k, v in parse_assignments(args.cpus, "--cpus").items()},
        gpus={k: float(v) for k, v in parse_assignments(args.gpus, "--gpus").items()},
        env={
            # One machine: a key pair for the run signs the weight versions (a cluster's
            # nodes get theirs from the environment or --env: docs/weights.md).
            **({} if args.address else run_signing_environment(run_dir)),
            **parse_assignments(args.env, "--env"),
            **recipe_variables(args.recipe),
        },
        nats_replicas=args.nats_replicas or 1,
        trainer_ranks=args.trainer_ranks,
        scale=ScalePolicy(
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            tasks_per_worker=args.tasks_per_worker,
            poll_s=args.poll_s,
        ),
    )
    _connect(args.address, local_cpus(plan))
    import ray

    controller = deploy(plan)
    ray.get(controller.status.remote())  # placed: the controller's __init__ has run
    print(f"deployed on Ray; run folder {run_dir}; bus {plan.nats_url}", flush=True)
    if args.address:
        return 0
    return _foreground(controller, args.duration_s, nats)


def _local_nats(run_dir: Path) -> Any:
    from libs.nats_server import NatsServer

    server = NatsServer(store_dir=run_dir / "nats", log_path=run_dir / "nats-server.log")
    server.start()
    return server


def _foreground(controller: Any, duration_s: float | None, nats: Any) -> int:
    """Print status until Ctrl-C or `duration_s`, then take the deployment down."""
    import ray

    started = time.monotonic()
    try:
        while duration_s is None or time.monotonic() - started < duration_s:
            print_status(ray.get(controller.status.remote()))
            time.sleep(10)
    except KeyboardInterrupt:
        print("stopping: the workers drain first", flush=True)
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller, no_restart=True)
        if nats is not None:
            nats.stop()
    return 0


def on_status(args: argparse.Namespace) -> int:
    import ray

    from apps.ray_deploy.controller import find_controller

    _connect(args.address or "auto")
    status = ray.get(find_controller().status.remote())
    status["cluster"] = {
        "resources": ray.cluster_resources(),
        "available": ray.available_resources(),
        "nodes": sum(1 for n in ray.nodes() if n.get("Alive")),
    }
    if args.json:
        print(json.dumps(status))
    else:
        print_status(status)
    return 0


def on_scale(args: argparse.Namespace) -> int:
    import ray

    from apps.ray_deploy.controller import find_controller

    ScalePolicy(min_workers=args.min_workers, max_workers=args.max_workers)  # refuses bad bounds
    _connect(args.address or "auto")
    bounds = ray.get(find_controller().set_bounds.remote(args.min_workers, args.max_workers))
    print(f"rollout-workers between {bounds['min_workers']} and {bounds['max_workers']}")
    return 0


def on_down(args: argparse.Namespace) -> int:
    import ray

    from apps.ray_deploy.controller import find_controller

    _connect(args.address or "auto")
    controller = find_controller()
    stopped = ray.get(controller.shutdown.remote())
    ray.kill(controller, no_restart=True)
    print(f"stopped: {', '.join(stopped)} and the rollout-workers")
    return 0


def print_status(status: dict[str, Any]) -> None:
    """One line per actor, then the rollout tier and the cluster."""
    for actor in sorted(status["actors"], key=lambda a: a["actor"]):
        health = actor.get("health") or {}
        print(
            f"{actor['actor']:<28} {actor.get('state', '?'):<11} "
            f"node {actor.get('node_ip', '?'):<15} pid {actor.get('pid', '-')!s:<8} "
            f"restarts {actor.get('restarts', 0)}  health {health.get('status', '-')}"
            + (f"  step {health['step']}" if "step" in health else "")
            + ("  draining" if actor.get("draining") else "")
        )
    print(
        f"rollout-workers {status['workers']} (min {status['min_workers']}, max "
        f"{status['max_workers']}); task backlog {status['backlog']}"
    )
    if "cluster" in status:
        cluster = status["cluster"]
        print(
            f"ray: {cluster['nodes']} nodes; CPU {cluster['available'].get('CPU', 0):g} of "
            f"{cluster['resources'].get('CPU', 0):g} free; GPU "
            f"{cluster['available'].get('GPU', 0):g} of {cluster['resources'].get('GPU', 0):g}"
        )
    sys.stdout.flush()
