"""`rlpipe nats-config`: the NATS servers' users and permissions, rendered from proto/.

    rlpipe nats-config render            # deploy/nats/auth.conf, region-auth.conf and the
                                         # identity table of SECURITY.md
    rlpipe nats-config render --check    # exit 1 when a shipped file is stale (CI, tests)
    rlpipe nats-config render --dir DIR  # somewhere else (your own deployment's copy)
    rlpipe nats-config passwords > .env  # a fresh password per role, as compose reads them
    rlpipe nats-config passwords --region   # the same for a regional server's users

A new subject, stream or role in proto/ reaches the servers' config through this command,
never by hand; tests/test_bus_permissions.py runs the check.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from libs.bus.auth_config import DEPLOY_DIR, new_password, rendered_files
from proto.permissions import REGION_ROLES, ROLES, password_variable


def add_nats_config_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "nats-config", help="render the NATS users and permissions from proto/"
    )
    actions = parser.add_subparsers(dest="nats_config_command", required=True)
    render = actions.add_parser("render", help="write (or check) deploy/nats/*auth.conf")
    render.add_argument("--dir", type=Path, default=DEPLOY_DIR, help="folder to write in")
    render.add_argument("--check", action="store_true", help="exit 1 if a file differs from proto/")
    passwords = actions.add_parser(
        "passwords", help="print RLPIPE_NATS_<ROLE>_PASSWORD=<fresh> for every role"
    )
    passwords.add_argument(
        "--region", action="store_true", help="a regional server's users instead of the hub's"
    )


def run(args: argparse.Namespace) -> int:
    if args.nats_config_command == "passwords":
        server = "region" if args.region else ""
        for name in REGION_ROLES if args.region else ROLES:
            print(f"{password_variable(name, server)}={new_password()}")
        return 0
    files = rendered_files(args.dir)
    if args.check:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run `rlpipe nats-config render`")
        if not stale:
            print(f"{', '.join(str(p) for p in files)}: up to date")
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0
