"""End to end through the real services: the trainer hands versions over as deltas it encoded.

`rlpipe demo` with `trainer.weight_handover=delta` (the default on a GPU; here on the CPU):
the first version crosses whole, every later one as a delta file encoded by the trainer's
encoder process; the broadcaster stores them as they are and the rollout worker swaps them
in. Read from the services' own logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.marks import E2E

pytestmark = E2E

REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS = 12


def events(log: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def test_versions_reach_the_worker_as_deltas_the_trainer_encoded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable, "-m", "apps.cli", "demo", "--run-dir", str(run_dir),
            "--max-trainer-steps", str(STEPS), "--duration-s", "240",
            "--set", "trainer.weight_handover=delta",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = run_dir / "logs"
    staged = events(logs / "trainer.log", "weights staged")
    assert staged[0]["kind"] == "state"
    deltas = [s["version"] for s in staged if s["kind"] == "delta"]
    assert len(deltas) == len(staged) - 1 >= STEPS // 2, staged
    announced = {
        a["version"]: a["base"]
        for a in events(logs / "weight-broadcaster.log", "weight version announced")
        if a["kind"] == "delta"
    }
    assert all(announced.get(v) is not None for v in deltas), (deltas, announced)
    assert not events(logs / "weight-broadcaster.log", "dead-lettered")
    swapped = [s["version"] for s in events(logs / "rollout-worker.log", "weights swapped")]
    assert set(deltas) & set(swapped), (deltas, swapped)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["services"]["trainer"]["exit"] == "exit 0"
