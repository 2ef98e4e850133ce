"""`rlpipe feedback-key`: create an API key for the feedback API and the entry the ingester
stores for it (the key's sha256, its name, its products; libs/feedback/auth.py).

    export RLPIPE_FEEDBACK_INGESTER_API_KEYS=$(rlpipe feedback-key \
        --name acme-web --products acme,acme-beta --key-out acme-web.key)
    rlpipe feedback-key --name acme-web --products acme --toml >> keys.toml

The entry, as the JSON list `RLPIPE_FEEDBACK_INGESTER_API_KEYS` takes, goes to stdout (with
`--toml`, a `[[keys]]` table for `RLPIPE_FEEDBACK_INGESTER_API_KEYS_FILE`); the key itself,
shown once, to stderr, or to the file `--key-out` names (mode 0600).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from libs.feedback.auth import ApiKeyEntry, hash_key, new_api_key


def add_feedback_key_parser(commands: argparse._SubParsersAction) -> None:
    """Register `feedback-key` on an argparse subparsers object."""
    parser = commands.add_parser(
        "feedback-key",
        help="create a feedback API key and the entry the ingester stores",
        description="Create a feedback API key: prints the entry the ingester stores (the "
        "key's hash) as the JSON list RLPIPE_FEEDBACK_INGESTER_API_KEYS takes, and the key "
        "itself (give it to the product, once) on stderr or into --key-out.",
    )
    parser.add_argument("--name", required=True, help="who holds the key, e.g. acme-web")
    parser.add_argument("--products", required=True, help="comma-separated products, or '*'")
    parser.add_argument(
        "--key-out", type=Path, help="write the key to this file (mode 0600), not to stderr"
    )
    parser.add_argument(
        "--toml", action="store_true", help="print a [[keys]] table for api_keys_file instead"
    )


def run(args: argparse.Namespace) -> int:
    key = new_api_key()
    products = [p.strip() for p in args.products.split(",") if p.strip()]
    entry = ApiKeyEntry(name=args.name, sha256=hash_key(key), products=products)
    if args.key_out is not None:
        args.key_out.touch(mode=0o600)
        args.key_out.write_text(key + "\n")
    else:
        print(f"key (shown once): {key}", file=sys.stderr)
    if args.toml:
        print(
            f'[[keys]]\nname = "{entry.name}"\nsha256 = "{entry.sha256}"\n'
            f"products = {json.dumps(entry.products)}"
        )
    else:
        print(json.dumps([entry.model_dump()]))
    return 0
