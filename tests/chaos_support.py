"""Kill each process of a running `rlpipe demo` once and measure what it cost.

    report = run_chaos(run_dir, repo_root, max_steps=160)
    report.kills            # per process: kill time, restart, recovery, drops around it
    report.accounting       # every scored sample by id: trained once, dropped, dead-lettered

Used by tests/test_chaos.py (the pass/fail) and bench/chaos_bench.py (the numbers of the
note). A kill is SIGKILL of the process's pid as `pids.json` names it (the services' and
nats-server's), never by name. Recovery of a kill is the time from the kill until the
trainer records a step after the killed process is running again; drops of a kill are the
samples the trainer dropped as stale from it until the next kill, against all it took then.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KILL_ORDER = (
    "reward",
    "weight-broadcaster",
    "rollout-worker",
    "env-gateway",
    "feedback-ingester",
    "trainer",
    "nats",
)
WINDOW_S = 60.0


@dataclass
class KillResult:
    """One process killed once, and what followed."""

    name: str
    killed_pid: int
    kill_time: float
    at_step: int
    restarted_after_s: float | None = None
    recovery_s: float | None = None  # kill -> first trainer step after the restart
    # The longest time without a trainer step from the kill to the next kill: a stall that
    # begins after the first step (the broadcaster's) shows here, not in recovery_s.
    longest_stall_s: float | None = None
    samples_in_window: int = 0  # trained + dropped from the kill to the next one
    dropped_in_window: int = 0
    # The measure: the minute around the kill (30 s each side; kills in one run are
    # closer than that, so neighbours share it).
    samples_in_minute: int = 0
    dropped_in_minute: int = 0

    @property
    def drop_fraction(self) -> float:
        return self.dropped_in_window / max(self.samples_in_window, 1)


@dataclass
class ChaosReport:
    exit_code: int | None
    summary: dict[str, Any]
    kills: list[KillResult] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    accounting: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        kills = [asdict(k) | {"drop_fraction": round(k.drop_fraction, 4)} for k in self.kills]
        return {
            "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 1),
            "stop_reason": self.summary.get("stop_reason"),
            "num_steps": len(effective_steps(self.steps)),
            "kills": kills,
            "accounting": self.accounting,
            "total_trained": sum(s["num_samples"] for s in effective_steps(self.steps)),
            "total_dropped": sum(s["num_dropped"] for s in effective_steps(self.steps)),
        }


def read_steps(run_dir: Path, name: str = "steps.jsonl") -> list[dict[str, Any]]:
    """The trainer's step records (or, with `name="step_samples.jsonl"`, each step's ids)."""
    path = run_dir / "trainer" / name
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return records


def effective_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each step, the record of the latest segment (a resumed trainer redoes the steps
    after its checkpoint; the first run's records of those are superseded)."""
    latest: dict[int, dict[str, Any]] = {}
    for record in records:
        latest[record["step"]] = record
    return [latest[step] for step in sorted(latest)]


def read_pids(run_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((run_dir / "pids.json").read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def current_pid(run_dir: Path, name: str) -> int | None:
    pids = read_pids(run_dir)
    found = pids.get("nats", []) if name == "nats" else pids.get("services", {}).get(name, [])
    return int(found[-1]) if found else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) counts as dead.
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except FileNotFoundError:
        return False
    return status != "Z"


def stop_demo(process: subprocess.Popen[Any], run_dir: Path, grace_s: float = 60.0) -> None:
    """Stop a demo still running (a test that failed or ran out of time): SIGINT, so the
    launcher drains its services and stops NATS, then SIGKILL; then SIGKILL whatever of
    `pids.json` still lives (a launcher killed outright leaves its NATS nodes and services,
    which run in sessions of their own, behind)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    pids = read_pids(run_dir)
    services = [pid for group in pids.get("services", {}).values() for pid in group]
    for pid in [*services, *pids.get("nats", [])]:
        if alive(int(pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _wait(condition: Any, timeout_s: float, poll_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return False


def run_chaos(
    run_dir: Path,
    repo_root: Path,
    *,
    max_steps: int = 160,
    first_kill_step: int = 15,
    steps_between: int = 8,
    recovery_timeout_s: float = 120.0,
    budget_s: float = 600.0,
    kills: tuple[str, ...] = KILL_ORDER,
    extra_args: tuple[str, ...] = (),
) -> ChaosReport:
    """Run `rlpipe demo` to `max_steps`, killing each of `kills` once along the way."""
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "demo.stdout", "wb")  # noqa: SIM115  # closed below
    demo = [sys.executable, "-m", "apps.cli", "demo", "--run-dir", str(run_dir)]
    bounds = ["--max-trainer-steps", str(max_steps), "--duration-s", str(int(budget_s))]
    process = subprocess.Popen(
        [*demo, *bounds, *extra_args],
        cwd=repo_root,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    report = ChaosReport(exit_code=None, summary={})
    try:
        _wait(lambda: _num_steps(run_dir) >= first_kill_step or process.poll() is not None, 300)
        for name in kills:
            if process.poll() is not None:
                break
            result = _kill_and_watch(run_dir, name, recovery_timeout_s)
            if result is not None:
                report.kills.append(result)
            target = _num_steps(run_dir) + steps_between
            _wait(lambda t=target: _num_steps(run_dir) >= t or process.poll() is not None, 120)
        remaining_s = max(10.0, budget_s + 120 - (time.monotonic() - started))
        process.wait(timeout=remaining_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    finally:
        stop_demo(process, run_dir)
        out.close()
    report.exit_code = process.returncode
    report.wall_s = time.monotonic() - started
    report.steps = read_steps(run_dir)
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        report.summary = json.loads(summary_path.read_text())
    attribute_drops(report.kills, report.steps)
    return report


def _num_steps(run_dir: Path) -> int:
    records = read_steps(run_dir)
    return max((r["step"] for r in records), default=0)


def _kill_and_watch(run_dir: Path, name: str, timeout_s: float) -> KillResult | None:
    pid = current_pid(run_dir, name)
    if pid is None or not alive(pid):
        return None
    at_step = _num_steps(run_dir)
    kill_time = time.time()
    os.kill(pid, signal.SIGKILL)
    result = KillResult(name=name, killed_pid=pid, kill_time=kill_time, at_step=at_step)

    def restarted() -> bool:
        new = current_pid(run_dir, name)
        return new is not None and new != pid and alive(new)

    if not _wait(restarted, timeout_s):
        return result
    restart_time = time.time()
    result.restarted_after_s = round(restart_time - kill_time, 2)

    def stepped() -> bool:
        return any(r["time"] > restart_time for r in read_steps(run_dir))

    if _wait(stepped, timeout_s):
        first = min(r["time"] for r in read_steps(run_dir) if r["time"] > restart_time)
        result.recovery_s = round(first - kill_time, 2)
    return result


def attribute_drops(kills: list[KillResult], steps: list[dict[str, Any]]) -> None:
    """Each kill's samples and stale drops: the steps recorded from it until the next kill
    (the last kill: until WINDOW_S after it), so a drop that comes a minute late still
    counts against the kill that caused it."""
    ordered = sorted(kills, key=lambda k: k.kill_time)
    ends = (
        [k.kill_time for k in ordered[1:]] + [ordered[-1].kill_time + WINDOW_S] if ordered else []
    )
    for result, end in zip(ordered, ends, strict=True):
        window = [s for s in effective_steps(steps) if result.kill_time <= s["time"] < end]
        times = [result.kill_time] + [s["time"] for s in window]
        result.longest_stall_s = (
            round(max(b - a for a, b in itertools.pairwise(times)), 2) if window else None
        )
        result.dropped_in_window = sum(s["num_dropped"] for s in window)
        result.samples_in_window = sum(s["num_samples"] + s["num_dropped"] for s in window)
        t = result.kill_time
        minute = [
            s for s in effective_steps(steps) if t - WINDOW_S / 2 <= s["time"] < t + WINDOW_S / 2
        ]
        result.dropped_in_minute = sum(s["num_dropped"] for s in minute)
        result.samples_in_minute = sum(s["num_samples"] + s["num_dropped"] for s in minute)


def account_samples(run_dir: Path) -> dict[str, Any]:
    """Every scored sample of the run by id, against the trainer's records and dead letters.

    Starts a nats-server on the run's JetStream folder (the demo stopped its own), reads
    RL_ROLLOUTS_SCORED and the dead letters, and the trainer's last checkpoint cursor."""
    import asyncio

    from libs.nats_server import NatsServer

    server = NatsServer(store_dir=run_dir / "nats", log_path=run_dir / "logs" / "nats-audit.log")
    server.start()
    try:
        stored, dead = asyncio.run(_read_scored_and_dead(server.url))
    finally:
        server.stop()
    samples = effective_steps(read_steps(run_dir, "step_samples.jsonl"))
    return audit(stored, dead, samples, _cursor(run_dir))


async def _read_scored_and_dead(url: str) -> tuple[list[tuple[int, str]], list[dict[str, Any]]]:
    from nats.js.errors import NotFoundError

    from libs.bus import wire
    from libs.bus.connection import connect_bus
    from proto import streams
    from proto.messages import DeadLetter, ScoredRollout

    bus = await connect_bus(url, name="chaos-audit")
    try:
        stored: list[tuple[int, str]] = []
        dead: list[dict[str, Any]] = []
        for stream in (streams.ROLLOUTS_SCORED.name, streams.DEAD_LETTERS.name):
            info = await bus.js.stream_info(stream)
            if info.state.messages == 0:
                continue
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    raw = await bus.js.get_msg(stream, seq=seq)
                except NotFoundError:
                    continue
                if stream == streams.DEAD_LETTERS.name:
                    letter = wire.decode(DeadLetter, raw.data or b"", None)
                    dead.append(
                        {
                            "origin_stream": letter.origin_stream,
                            "sequence": letter.stream_sequence,
                            "reason": letter.reason,
                            "consumer": letter.consumer,
                            "error": letter.error[:200],
                        }
                    )
                    continue
                sample = wire.decode(ScoredRollout, raw.data or b"", raw.headers)
                stored.append((seq, sample.rollout.rollout_id))
        return stored, dead
    finally:
        await bus.close()


def _cursor(run_dir: Path) -> tuple[int, set[int]]:
    checkpoints = sorted((run_dir / "trainer" / "checkpoints").glob("step-*/state.json"))
    if not checkpoints:
        return 0, set()
    state = json.loads(checkpoints[-1].read_text())
    cursor = state["scored_cursor"]
    return int(cursor["floor"]), set(_done_sequences(cursor))


def _done_sequences(cursor: dict[str, Any]) -> list[int]:
    """The done sequences above the floor, whichever way the cursor stores them."""
    if "done" in cursor:
        return [int(s) for s in cursor["done"]]
    return [s for start, end in cursor.get("done_runs", []) for s in range(start, end + 1)]


def audit(
    stored: list[tuple[int, str]],
    dead: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    cursor: tuple[int, set[int]],
) -> dict[str, Any]:
    """Counts a user cares about: trained twice, stored twice, consumed but unaccounted."""
    trained = [sid for s in steps for sid in s["sample_ids"]]
    dropped = [sid for s in steps for sid in s["dropped_ids"]]
    skipped = [sid for s in steps for sid in s.get("skipped_ids", [])]
    dead_ids = {d["sequence"] for d in dead if d["origin_stream"] == "RL_ROLLOUTS_SCORED"}
    seqs_of: dict[str, list[int]] = {}
    for seq, sid in stored:
        seqs_of.setdefault(sid, []).append(seq)
    floor, done = cursor
    consumed = {sid for seq, sid in stored if seq <= floor or seq in done}
    accounted = set(trained) | set(dropped) | set(skipped)
    unaccounted = sorted(
        sid
        for sid in consumed
        if sid not in accounted and not all(seq in dead_ids for seq in seqs_of[sid])
    )
    return {
        "stored": len(stored),
        "stored_twice": sum(len(seqs) > 1 for seqs in seqs_of.values()),
        "consumed": len(consumed),
        "trained": len(trained),
        "trained_twice": len(trained) - len(set(trained)),
        "dropped": len(dropped),
        "dead_lettered": len(dead_ids),
        "dead_letters_by_reason": _count(d["reason"] for d in dead),
        "unaccounted": len(unaccounted),
        "unaccounted_first": unaccounted[:5],
        "cursor_floor": floor,
        "cursor_done_size": len(done),
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts
