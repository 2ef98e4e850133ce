"""End to end through the real services on a real nats-server: the built-in task is learned.

`rlpipe demo` starts NATS, the trainer, a rollout worker, the env-gateway (copy task,
difficulty 0), reward and the weight-broadcaster; the test reads the trainer's step records
until the mean reward of the last 10 steps is above 0.8, then stops the run with SIGINT.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.marks import E2E

pytestmark = E2E

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480


def rewards(run_dir: Path) -> list[float]:
    path = run_dir / "trainer" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["mean_reward"] for line in path.read_text().splitlines()]


def test_demo_learns_the_builtin_task(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--duration-s",
            str(BUDGET_S),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + BUDGET_S + 60
    curve: list[float] = []
    try:
        while process.poll() is None and time.monotonic() < deadline:
            curve = rewards(run_dir)
            if len(curve) >= 20 and sum(curve[-10:]) / 10 > 0.8:
                break
            time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    curve = rewards(run_dir)
    assert process.returncode == 0
    assert len(curve) >= 20, f"only {len(curve)} trainer steps in {BUDGET_S} s"
    first, best_last = (
        sum(curve[:10]) / 10,
        max(sum(curve[i - 10 : i]) / 10 for i in range(10, len(curve) + 1)),
    )
    assert first < 0.2, f"the task is learned from the start? first 10 steps: {curve[:10]}"
    assert best_last > 0.8, f"mean reward never above 0.8 over 10 steps: {curve}"
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["trainer_reward_first_10"] < 0.2
