"""Chaos run for the note: `rlpipe demo` with each service and nats-server killed once.

    .venv/bin/python bench/chaos_bench.py --run-dir /tmp/chaos --max-steps 160

Prints one JSON object: per kill the restart and recovery time and the samples dropped in
the minute after it; the accounting of every scored sample by id (tests/chaos_support.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.chaos_support import account_samples, run_chaos  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=160)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="checkout to run")
    args = parser.parse_args()
    report = run_chaos(
        args.run_dir, args.repo.resolve(), max_steps=args.max_steps, budget_s=args.budget_s
    )
    result = report.as_dict()
    try:
        result["accounting"] = account_samples(args.run_dir)
    except Exception as exc:  # the numbers above are still worth printing
        result["accounting"] = {"error": repr(exc)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
