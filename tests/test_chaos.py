"""Each service and nats-server killed once (SIGKILL) during a bounded `rlpipe demo` run:
the launcher brings every one back, training reaches its step bound and learns, every
scored sample is accounted for by id (trained once, dropped as stale, or dead-lettered; none
stored twice), and no kill costs more than a bounded share of the samples around it.

The measurement itself is tests/chaos_support.py (also `bench/chaos_bench.py` for the
numbers); the run takes a few minutes on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos_support import KILL_ORDER, account_samples, effective_steps, run_chaos

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 150
# Before this was fixed one kill (the broadcaster's) cost 45,808 of the 48,368 samples taken
# until the next kill, and the run 71% of all it consumed. Now: the run loses under 5%, and
# no kill more than a quarter of the samples taken until the next kill (about 15 s: the
# trainer's own kill, which redoes the steps after its checkpoint, comes closest).
MAX_RUN_DROP_FRACTION = 0.05
MAX_KILL_DROP_FRACTION = 0.25


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_every_process_killed_once_and_training_still_reaches_its_bound(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    report = run_chaos(run_dir, REPO_ROOT, max_steps=MAX_STEPS, budget_s=540)
    accounting = account_samples(run_dir)
    (tmp_path / "chaos.json").write_text(json.dumps(report.as_dict() | {"acc": accounting}))

    assert [k.name for k in report.kills] == list(KILL_ORDER), report.as_dict()
    for kill in report.kills:
        assert kill.restarted_after_s is not None, f"{kill.name} did not come back"
        assert kill.recovery_s is not None, f"no step after {kill.name} came back"
        assert kill.drop_fraction <= MAX_KILL_DROP_FRACTION, kill
    assert report.exit_code == 0 and report.summary["stop_reason"] == "max_trainer_steps"
    steps = effective_steps(report.steps)
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    rewards = [s["mean_reward"] for s in steps if s.get("stream", "offline") == "offline"]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.2, rewards
    assert accounting["dropped"] <= MAX_RUN_DROP_FRACTION * accounting["consumed"], accounting
    assert accounting["trained_twice"] == 0, accounting
    assert accounting["stored_twice"] == 0, accounting
    assert accounting["unaccounted"] == 0, accounting
