"""What each poison message does to a running `rlpipe demo`, for the note (before and after).

    .venv/bin/python bench/poison_bench.py --run-dir /tmp/poison --repo .

Starts the demo from `--repo` (any checkout), waits for 5 trainer steps, publishes every
case of tests/poison_support.py, watches for `--watch-s` seconds, stops the demo and prints
one JSON object: per case its dead letter (reason, consumer) or none; the services'
restarts; trainer steps before and after the poison. Unlike tests/test_poison.py it asserts
nothing, so it runs against code that does not handle poison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.poison_support import poison_cases  # noqa: E402
from tests.test_poison import (  # noqa: E402
    dead_letters,
    nats_url,
    num_steps,
    publish,
    wait_until,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--repo", type=Path, default=Path.cwd())
    parser.add_argument("--watch-s", type=float, default=90.0)
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    stdout_path = args.run_dir / "demo.stdout"
    env = {
        **os.environ,
        "RLPIPE_TRAINER_ONLINE_FRACTION": "0.05",
        "RLPIPE_TRAINER_ONLINE_STREAM_WAIT_S": "0",
    }
    demo = [sys.executable, "-m", "apps.cli", "demo", "--run-dir", str(args.run_dir)]
    with stdout_path.open("wb") as out:
        process = subprocess.Popen(
            [*demo, "--duration-s", str(int(args.watch_s + 300))],
            cwd=args.repo.resolve(),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    result: dict[str, object] = {}
    try:
        wait_until(lambda: num_steps(args.run_dir) >= 5, 240, "five trainer steps")
        url = nats_url(stdout_path)
        assert url is not None
        stored = asyncio.run(publish(url, poison_cases()))
        result["steps_at_poison"] = num_steps(args.run_dir)
        time.sleep(args.watch_s)
        result["steps_after_watch"] = num_steps(args.run_dir)
        letters = asyncio.run(dead_letters(url))
        result["cases"] = [
            {
                "subject": case.subject,
                "kind": case.kind,
                "what": case.what,
                "dead_letter": (
                    [letters[(stream, seq)].reason, letters[(stream, seq)].consumer]
                    if (stream, seq) in letters
                    else None
                ),
            }
            for case, stream, seq in stored
        ]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    summary_path = args.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result["restarts"] = {name: s["restarts"] for name, s in summary.get("services", {}).items()}
    result["exit_code"] = process.returncode
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
