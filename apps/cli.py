"""`rlpipe`: the one command users run.

rlpipe demo [--duration-s N] [--max-trainer-steps N] [--run-dir DIR]
                                  NATS + every service on this machine, supervised
rlpipe run SERVICE [--set SERVICE.FIELD=VALUE]
                                  one service, configured by RLPIPE_* variables
rlpipe config show SERVICE | check
                                  every setting and where it came from; validate them all
rlpipe provision [--nats-url URL] create or update streams, consumers, KV buckets (as the
                                  admin: RLPIPE_NATS_USER/RLPIPE_NATS_PASSWORD)
rlpipe report RUN_DIR [--no-plots]
                                  a run's summary and plots (reward, staleness, throughput)
rlpipe sft --data DEMOS.jsonl --out MODEL_DIR [--steps N]
                                  train a policy on chat transcripts (the mid-training stage)
rlpipe domain list | demos --env ENV --out FILE | evaluate --env ENV [--policy-path DIR]
                                  domains; an expert's demonstrations; a policy's level
rlpipe feedback-key --name NAME --products P [--key-out FILE] [--toml]
                                  a feedback API key and the entry the ingester stores
rlpipe feedback-events list|purge --key NAME[:KEY_ID]
                                  what one feedback key sent, everywhere; purge deletes it
rlpipe fleet status | decisions | lend REPLICA | recall REPLICA
                                  the serving fleet: what each replica serves, the
                                  capacity controller's decisions, lending by hand
rlpipe schema [--check]           write (or check) the JSON Schema in proto/schema/
rlpipe nats-config render [--check] | passwords
                                  write (or check) deploy/nats/auth.conf from proto/;
                                  a fresh password per role, as .env lines
rlpipe weights diff|apply|verify|snapshot ...
                                  lossless weight deltas of safetensors files
rlpipe weights relay-setup --hub-domain HUB [--nats-url URL]
                                  mirror the hub's weight streams into a region
rlpipe region setup|hub-setup|status [--nats-url URL] ...
                                  a region that keeps working on its own server
rlpipe ray up|status|scale|down [--address ADDR] ...
                                  the services as Ray actors: placed, restarted, the
                                  rollout-workers scaled with the task backlog (the ray extra)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from libs.settings import ServiceSettings, SettingsError
from proto.services import OPTIONAL_SERVICES, SERVICES, service_module


def settings_classes() -> dict[str, Callable[[], type[ServiceSettings]]]:
    """Each service's settings class, imported when asked for (`rlpipe config`, `--set`)."""

    def loader(service: str) -> Callable[[], type[ServiceSettings]]:
        def load() -> type[ServiceSettings]:
            module = importlib.import_module(f"{service_module(service)}.settings")
            found = [
                value
                for value in vars(module).values()
                if isinstance(value, type)
                and issubclass(value, ServiceSettings)
                and service == value.SERVICE
            ]
            return found[0]

        return load

    return {service: loader(service) for service in (*SERVICES, *OPTIONAL_SERVICES)}


def build_parser() -> argparse.ArgumentParser:
    from apps.config_cli import add_config_parser, add_set_argument
    from apps.domains_cli import add_domain_parser
    from apps.feedback_events_cli import add_feedback_events_parser
    from apps.feedback_key_cli import add_feedback_key_parser
    from apps.fleet_cli import add_fleet_parser
    from apps.launcher.arguments import add_demo_arguments
    from apps.nats_config_cli import add_nats_config_parser
    from apps.ray_deploy.cli import add_ray_parser
    from apps.region_cli import add_region_parser
    from apps.report.command import add_report_parser
    from apps.sandbox_cli import add_sandbox_parser
    from apps.sft_cli import add_sft_parser
    from apps.weights_cli import add_weights_parser

    parser = argparse.ArgumentParser(
        prog="rlpipe",
        description="Pipelined RL of LLM agents over NATS JetStream.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run NATS and every service locally, supervised")
    add_demo_arguments(demo)
    add_set_argument(demo)
    run = commands.add_parser(
        "run",
        help="run one service against RLPIPE_NATS_URL",
        description="Run one service. Its settings, their defaults and where each value comes "
        "from: rlpipe config show SERVICE.",
    )
    run.add_argument("service", choices=(*SERVICES, *OPTIONAL_SERVICES))
    add_set_argument(run)
    add_config_parser(commands, (*SERVICES, *OPTIONAL_SERVICES))
    provision = commands.add_parser("provision", help="create or update the bus definitions")
    provision.add_argument(
        "--nats-url", default=os.environ.get("RLPIPE_NATS_URL", "nats://127.0.0.1:4222")
    )
    provision.add_argument(
        "--replicas",
        type=int,
        default=int(os.environ.get("RLPIPE_NATS_REPLICAS", "1")),
        help="nodes that keep each stream and bucket: 1, or 3 on a NATS cluster",
    )
    schema = commands.add_parser("schema", help="write the wire contract's JSON Schema")
    schema.add_argument("--check", action="store_true", help="exit 1 if proto/schema is stale")
    add_weights_parser(commands)
    add_nats_config_parser(commands)
    add_sandbox_parser(commands)
    add_feedback_key_parser(commands)
    add_fleet_parser(commands)
    add_feedback_events_parser(commands)
    add_sft_parser(commands)
    add_domain_parser(commands)
    add_ray_parser(commands)
    add_region_parser(commands)
    add_report_parser(commands)
    return parser


def with_overrides(args: argparse.Namespace, services: Sequence[str] = ()) -> bool:
    """Check `--set` overrides and hand them to the services (RLPIPE_SET), then load the
    settings of `services` as they will start; False after printing what is wrong."""
    from apps.config_cli import apply_overrides, check_services

    try:
        apply_overrides(args.overrides, settings_classes())
        check_services(settings_classes(), services)
    except SettingsError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return False
    return True


def on_demo(args: argparse.Namespace) -> int:
    import structlog

    from apps.launcher.arguments import options_from_args
    from apps.launcher.recipe import recipe_in_use
    from apps.launcher.run import run_local
    from apps.launcher.weight_keys import run_keys_assumed

    try:
        options = options_from_args(args)
    except ValueError as exc:  # a flag's or the recipe's mistake (a bad dataset row): exit 2
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    # Every service's settings are checked here, as the recipe sets them: a typo or a bad
    # value is one line, now.
    with recipe_in_use(options.recipe), run_keys_assumed():
        if not with_overrides(args, options.services):
            return 2

    # Library log lines (provisioning) go to stderr, warnings and errors only: the launcher
    # reports what happens itself (apps.launcher.status_view).
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    return run_local(options)


def on_run(args: argparse.Namespace) -> int:
    if not with_overrides(args):
        return 2
    module = importlib.import_module(f"{service_module(args.service)}.__main__")
    module.main()
    return 0


def on_provision(args: argparse.Namespace) -> int:
    from libs.bus.connection import BusConnectError, options_from_environment
    from libs.bus.provision import ProvisionError, provision_bus
    from libs.logs import configure_logging

    configure_logging("provision")
    # As the admin: RLPIPE_NATS_USER=admin and its password (or in the URL), TLS options.
    options = options_from_environment(os.environ)
    try:
        report = asyncio.run(provision_bus(args.nats_url, args.replicas, options))
    except (BusConnectError, ProvisionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, outcome in report.outcomes.items():
        print(f"{outcome:>9}  {name}")
    return 0


def on_schema(args: argparse.Namespace) -> int:
    from proto.schema import main as schema_main

    return schema_main(["--check"] if args.check else [])


def on_nats_config(args: argparse.Namespace) -> int:
    from apps.nats_config_cli import run

    return run(args)


def on_config(args: argparse.Namespace) -> int:
    from apps.config_cli import run

    return run(args, settings_classes())


def on_weights(args: argparse.Namespace) -> int:
    from apps.weights_cli import run

    return run(args)


def on_ray(args: argparse.Namespace) -> int:
    from apps.ray_deploy.cli import run

    return run(args)


def on_sandbox(args: argparse.Namespace) -> int:
    from apps.sandbox_cli import run

    return run(args)


def on_feedback_key(args: argparse.Namespace) -> int:
    from apps.feedback_key_cli import run

    return run(args)


def on_feedback_events(args: argparse.Namespace) -> int:
    from apps.feedback_events_cli import run

    return run(args)


def on_fleet(args: argparse.Namespace) -> int:
    from apps.fleet_cli import run

    return run(args)


def on_region(args: argparse.Namespace) -> int:
    from apps.region_cli import run

    return run(args)


def on_report(args: argparse.Namespace) -> int:
    from apps.report.command import run

    return run(args)


def on_domain(args: argparse.Namespace) -> int:
    from apps.domains_cli import run
    from libs.logs import configure_logging

    configure_logging("domain", level="warning")
    return run(args)


def on_sft(args: argparse.Namespace) -> int:
    from apps.sft_cli import run
    from libs.logs import configure_logging

    configure_logging("sft")
    return run(args)


HANDLERS = {
    "demo": on_demo,
    "run": on_run,
    "provision": on_provision,
    "schema": on_schema,
    "nats-config": on_nats_config,
    "config": on_config,
    "weights": on_weights,
    "sandbox": on_sandbox,
    "feedback-key": on_feedback_key,
    "fleet": on_fleet,
    "feedback-events": on_feedback_events,
    "ray": on_ray,
    "region": on_region,
    "sft": on_sft,
    "domain": on_domain,
    "report": on_report,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return HANDLERS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
