"""Seeing a run, through the real commands: the live view, the trackers, `rlpipe report`.

One `rlpipe demo` runs under a pseudo-terminal (pexpect) with every tracker on: the tests read
what its terminal showed, then what TensorBoard, W&B and MLflow recorded (each read back with
its own library), then run `rlpipe report` on its folder. A missing tracker extra and a typo
in the backends are refused at start with one line each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pexpect
import pytest

from libs.trainer.metrics import latest_per_step, read_evals, read_steps
from tests.marks import E2E
from tests.test_launcher import kill_leftovers

pytestmark = E2E

PY = sys.executable
REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS = 12  # past the eval gate's version 10, so a decision follows a trained version
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
PLOTS = (
    "reward.png",
    "staleness.png",
    "throughput.png",
    "mismatch.png",
    "training.png",
    "episodes.png",
)


@dataclass(frozen=True)
class DemoRun:
    run_dir: Path
    screen: str  # everything the terminal showed, escape sequences removed
    exit_code: int | None


def read_terminal(child: pexpect.spawn, timeout_s: float) -> str:
    """Everything the child writes to its terminal until it exits (or `timeout_s`)."""
    chunks: list[str] = []
    while True:
        try:
            chunks.append(child.read_nonblocking(65536, timeout=timeout_s))
        except pexpect.EOF:
            return "".join(chunks)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    run_dir = tmp_path_factory.mktemp("see_a_run") / "run"
    env = {
        **os.environ,
        "TERM": "xterm-256color",
        # The terminal's size is the pty's: pytest-xdist workers export COLUMNS=80, LINES=24.
        "COLUMNS": "200",
        "LINES": "50",
        "RLPIPE_TRAINER_TRACKING_BACKENDS": "tensorboard,wandb,mlflow",
    }
    args = ["-m", "apps.cli", "demo", "--max-trainer-steps", str(STEPS)]
    child = pexpect.spawn(
        PY,
        [*args, "--run-dir", str(run_dir)],
        cwd=str(REPO_ROOT),
        env=env,
        dimensions=(50, 200),
        encoding="utf-8",
        codec_errors="replace",
    )
    try:
        raw = read_terminal(child, timeout_s=420)
        child.close()
        yield DemoRun(run_dir, ANSI.sub("", raw), child.exitstatus)
    finally:
        if child.isalive():
            child.kill(9)
        kill_leftovers(run_dir)


def offline_steps(run_dir: Path) -> list[Any]:
    return [r for r in latest_per_step(read_steps(run_dir)) if r.stream == "offline"]


@pytest.mark.timeout(600)
def test_live_view_shows_progress_reward_throughput_and_versions(demo: DemoRun) -> None:
    screen = demo.screen
    assert demo.exit_code == 0, screen[-3000:]
    steps = [int(s) for s in re.findall(rf"trainer step (\d+)/{STEPS}\b", screen)]
    assert len(set(steps)) >= 3 and max(steps) >= STEPS // 2, f"progress seen: {sorted(set(steps))}"
    percents = [int(p) for p in re.findall(r"(\d+)% +ETA (?:\d+m)?\d+s", screen)]
    assert percents and max(percents) > min(percents), "the bar and its ETA move"
    for figure in (r"reward \d\.\d\d", r"samples/s \d+\.\d", r"staleness \d+\.\d\d"):
        assert re.search(figure, screen), f"no {figure!r} on the screen"
    # The workers' row: the version it holds and how far behind the trainer's.
    assert re.search(r"rollout-worker .* v\d+ \(\d+ behind\)", screen)
    assert "restarts" in screen
    # A normal start and stop: no warning, no traceback.
    assert not re.search(r"warning|traceback|disconnected", screen, re.IGNORECASE), screen


@pytest.mark.timeout(600)
def test_demo_ends_with_a_human_summary_and_where_the_plots_are(demo: DemoRun) -> None:
    ending = demo.screen[demo.screen.rindex("run reached its trainer step bound") :]
    lines = ending.splitlines()
    assert str(demo.run_dir.resolve()) in lines[0] and "exit code 0" in lines[0]
    assert any(line.startswith("reward: ") and " -> " in line for line in lines)
    assert any(line.startswith(f"plots: {demo.run_dir.resolve()}/report/") for line in lines)
    assert all((demo.run_dir / "report" / name).exists() for name in PLOTS)
    # On a terminal the JSON summary stays in summary.json, not on the screen.
    assert not any(line.lstrip().startswith("{") for line in lines)
    summary = json.loads((demo.run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["trainer_step"] == STEPS


@pytest.mark.timeout(600)
def test_tensorboard_reads_the_step_metrics_the_trainer_recorded(demo: DemoRun) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = offline_steps(demo.run_dir)
    assert len(steps) == STEPS
    events = EventAccumulator(str(demo.run_dir / "tracking" / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("reward/mean")}
    assert logged == pytest.approx({s.step: s.mean_reward for s in steps}, rel=1e-6)
    rates = {e.step: e.value for e in events.Scalars("train/learning_rate")}
    assert rates == pytest.approx({s.step: s.learning_rate for s in steps}, rel=1e-6)
    tags = set(events.Tags()["scalars"])
    wanted = {"reward/success", "staleness/mean", "throughput/samples_per_s", "mismatch/kl"}
    assert wanted | {"importance/weight_mean", "time/busy_fraction"} <= tags
    decisions = read_evals(demo.run_dir)
    assert len(decisions) >= 2, "the gate judged the first weights and a trained version"
    scores = {e.step: e.value for e in events.Scalars("eval/candidate_score")}
    assert scores == pytest.approx({d.step: d.candidate_score for d in decisions}, rel=1e-6)


@pytest.mark.timeout(600)
def test_wandb_offline_run_holds_every_step_read_by_wandb_itself(demo: DemoRun) -> None:
    [run_folder] = (demo.run_dir / "tracking" / "wandb").glob("offline-run-*")
    wandb = Path(PY).with_name("wandb")
    inspect = subprocess.run(
        [str(wandb), "leet", "inspect", "--json", str(run_folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.strip()]
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["telemetry"]["feature"]["offline"] and run["project"] == "rlpipe"
    assert run["config"]["update"]["batch_groups"] == 16
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    rewards = {h["_step"]: h["reward/mean"] for h in history if "reward/mean" in h}
    steps = offline_steps(demo.run_dir)
    assert rewards == pytest.approx({s.step: s.mean_reward for s in steps}, rel=1e-6)
    rates = {h["_step"]: h["train/learning_rate"] for h in history if "train/learning_rate" in h}
    assert rates == pytest.approx({s.step: s.learning_rate for s in steps}, rel=1e-6)


@pytest.mark.timeout(600)
def test_mlflow_file_store_holds_the_run_and_its_parameters(demo: DemoRun) -> None:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    tracking = demo.run_dir / "tracking"
    client = MlflowClient(tracking_uri=(tracking / "mlruns").resolve().as_uri())
    run = client.get_run((tracking / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.data.params["max_staleness"] == "4"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    steps = offline_steps(demo.run_dir)
    logged = {m.step: m.value for m in history}
    assert logged == pytest.approx({s.step: s.mean_reward for s in steps}, rel=1e-6)


@pytest.mark.timeout(600)
def test_report_writes_the_plots_and_summarizes_the_steps(demo: DemoRun, tmp_path: Path) -> None:
    out = tmp_path / "plots"
    report = rlpipe("report", str(demo.run_dir), "--out", str(out))
    assert report.returncode == 0, report.stderr
    for name in PLOTS:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, name
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert width >= 1200 and height >= 400, (name, width, height)
    steps = offline_steps(demo.run_dir)
    first = sum(s.mean_reward for s in steps[:10]) / 10
    last = sum(s.mean_reward for s in steps[-10:]) / 10
    lines = report.stdout.splitlines()
    assert lines[0].startswith(f"trainer: {STEPS} steps")
    assert f"reward: {first:.2f} -> {last:.2f}" in report.stdout
    assert lines[-1] == f"plots: {out}/ ({', '.join(PLOTS)})"
    assert "episodes: turns 1.00 -> 1.00, context segments 1.00 -> 1.00" in report.stdout

    # Held-out episodes of the first decision beside the last's, task by task.
    evals = read_evals(demo.run_dir)
    first_version, last_version = evals[0].version, evals[-1].version
    assert first_version < last_version
    page = (out / "transcripts.md").read_text()
    assert lines[-2] == (
        f"transcripts: {out / 'transcripts.md'} (3 held-out tasks at version {first_version} "
        f"and {last_version})"
    )
    assert page.count("\n## Task ") == 3
    assert page.count(f"Before: version {first_version}, reward ") == 3
    assert page.count(f"After: version {last_version}, reward ") == 3
    assert page.count("```text\n[user]\n") == 6  # each episode opens with the task's prompt

    summary_only = rlpipe("report", str(demo.run_dir), "--no-plots")
    assert summary_only.returncode == 0
    *summary, transcripts = summary_only.stdout.splitlines()  # the page in RUN_DIR/report
    assert summary == lines[:-2] and transcripts.startswith(
        f"transcripts: {demo.run_dir / 'report' / 'transcripts.md'} (3 held-out tasks"
    )


def test_report_on_a_folder_without_a_run_says_so_in_one_line(tmp_path: Path) -> None:
    report = rlpipe("report", str(tmp_path))
    assert report.returncode == 2 and report.stdout == ""
    assert report.stderr.splitlines() == [
        f"error: {tmp_path}: no trainer step recorded (trainer/steps.jsonl)"
    ]


def test_a_tracker_whose_extra_is_missing_stops_the_trainer_with_the_install_line() -> None:
    # The interpreter finds no wandb (as without the extra); the trainer's own main runs.
    code = (
        "import runpy, sys; sys.modules['wandb'] = None; "
        "runpy.run_module('services.trainer', run_name='__main__')"
    )
    env = {**os.environ, "RLPIPE_TRAINER_TRACKING_BACKENDS": "tensorboard,wandb"}
    result = subprocess.run(
        [PY, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("error: trainer.tracking.backends")
    assert "pip install 'rlpipe[wandb]'" in line


def test_a_misspelt_tracker_is_refused_naming_the_choices() -> None:
    env = {**os.environ, "RLPIPE_TRAINER_TRACKING_BACKENDS": "tensorbord"}
    result = subprocess.run(
        [PY, "-m", "services.trainer"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line == (
        "error: trainer.tracking.backends = 'tensorbord': unknown tracker 'tensorbord': "
        "choose from tensorboard, wandb, mlflow (env RLPIPE_TRAINER_TRACKING_BACKENDS)"
    )


def rlpipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "apps.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
