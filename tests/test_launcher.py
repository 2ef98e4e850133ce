"""The local launcher: supervision (restart with backoff, clean stop, SIGKILL after the grace
period), a whole run with stand-in services, and `rlpipe demo` end to end.

Children are real processes; stand-in services are small Python programs that answer
`/healthz` like the real ones. The end-to-end test needs the real services and is `slow`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from apps.launcher.health import HealthMonitor
from apps.launcher.run import LaunchOptions, run_local
from apps.launcher.status_view import Bound, LauncherLog, StatusView
from apps.launcher.supervisor import Backoff, ChildSpec, ChildState, Supervisor
from proto.services import SERVICES as ALL_SERVICES
from tests.conftest import wait_for
from tests.marks import E2E

PY = sys.executable
REPO_ROOT = Path(__file__).resolve().parent.parent

CRASHER = "import sys, time; time.sleep(0.05); sys.exit(3)"
# Exits 0 on SIGTERM, like a service that drained.
POLITE = (
    "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\ntime.sleep(600)"
)
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\ntime.sleep(600)"
)
# Ends by itself 1.5 s after "ready", exit 0; a SIGTERM before that makes it exit 1, as a
# torchrun agent does whatever its ranks were doing.
FINISHING = (
    "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(1))\n"
    "print('ready', flush=True)\ntime.sleep(1.5)"
)
# Leaves a grandchild in its process group that ignores SIGTERM, as a sandboxed tool might:
# only the SIGKILL the supervisor sends to the group after its leader exits removes it.
PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n"
    "print(f'grandchild {child.pid}', flush=True)\ntime.sleep(600)"
)

# A stand-in service: answers /healthz on its port like the real ones (the trainer counts
# ten steps a second) and exits 0 on SIGTERM. argv[1] is the package name.
FAKE_SERVICE = r"""
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

pkg, started = sys.argv[1], time.monotonic()

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"service": pkg, "status": "ok", "detail": "stand-in"}
        if pkg == "trainer":
            body.update(step=int((time.monotonic() - started) / 0.1), reward_mean=0.25)
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
port = int(os.environ[f"RLPIPE_{pkg.upper()}_HTTP_PORT"])
server = ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
print("serving", port, flush=True)
signal.sigwait({signal.SIGTERM})
server.shutdown()
"""


def fake_commands() -> dict[str, list[str]]:
    return {name: [PY, "-c", FAKE_SERVICE, name.replace("-", "_")] for name in ALL_SERVICES}


def is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or condition}")
        time.sleep(0.02)


def log_text(child: ChildState) -> str:
    return child.log_path.read_text() if child.log_path.exists() else ""


def recorded_pids(run_dir: Path) -> list[int]:
    pids = json.loads((run_dir / "pids.json").read_text())
    return [*pids["nats"], *(pid for group in pids["services"].values() for pid in group)]


def kill_leftovers(run_dir: Path) -> None:
    """After a failed test: SIGKILL the groups of recorded pids that still lead one."""
    if not (run_dir / "pids.json").exists():
        return
    for pid in recorded_pids(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if is_alive(pid) and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)


def last_json_line(stdout: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return summary


# --- supervisor -------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    assert [backoff.delay_s(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


async def test_crashing_child_is_restarted_with_growing_delays(tmp_path: Path) -> None:
    spawned_at: list[float] = []
    backoff = Backoff(initial_s=0.1, max_s=0.4)
    supervisor = Supervisor(
        [ChildSpec("crasher", [PY, "-c", CRASHER])],
        tmp_path,
        backoff,
        on_spawn=lambda _: spawned_at.append(time.monotonic()),
    )
    child = supervisor.children["crasher"]
    await supervisor.start()
    await wait_for(lambda: child.restarts >= 4, timeout_s=60, what="four restarts")
    await supervisor.stop(grace_s=5)

    assert len(set(child.pids)) == len(child.pids) >= 5
    gaps = [later - earlier for earlier, later in itertools.pairwise(spawned_at)]
    # Each gap is the child's ~0.05 s life plus the backoff delay: 0.1, 0.2, 0.4, 0.4.
    for gap, delay_s in zip(gaps, [0.1, 0.2, 0.4, 0.4], strict=False):
        assert gap >= delay_s
    assert log_text(child).count("=== launcher: start #") == len(child.pids)
    assert not any(is_alive(pid) for pid in child.pids)


async def test_stop_leaves_no_process_alive(tmp_path: Path) -> None:
    specs = [ChildSpec("polite", [PY, "-c", POLITE]), ChildSpec("parent", [PY, "-c", PARENT])]
    supervisor = Supervisor(specs, tmp_path)
    await supervisor.start()
    polite, parent = supervisor.children["polite"], supervisor.children["parent"]
    await wait_for(
        lambda: "ready" in log_text(polite) and "ready" in log_text(parent),
        what="children and grandchild ready",
    )
    grandchild = int(log_text(parent).split("grandchild ")[1].split()[0])
    assert is_alive(grandchild)

    await supervisor.stop(grace_s=5)

    assert polite.state == "stopped" and polite.last_exit_code == 0
    assert parent.state == "exited" and parent.restarts == 0
    pids = [*polite.pids, *parent.pids, grandchild]
    # SIGKILL is delivered asynchronously: allow the kernel a moment, then nothing may remain.
    wait_until(lambda: not any(is_alive(pid) for pid in pids), what=f"{pids} to go")


async def test_a_child_finishing_on_its_own_is_let_finish(tmp_path: Path) -> None:
    # The trainer at its step bound stops itself; the run stops everything at once.
    for finishing, code, state in (((), 1, "exited"), (("trainer",), 0, "stopped")):
        folder = tmp_path / str(code)
        specs = [
            ChildSpec("trainer", [PY, "-c", FINISHING]),
            ChildSpec("polite", [PY, "-c", POLITE]),
        ]
        supervisor = Supervisor(specs, folder)
        await supervisor.start()
        trainer, polite = supervisor.children["trainer"], supervisor.children["polite"]
        await wait_for(
            lambda: "ready" in log_text(trainer) and "ready" in log_text(polite),  # noqa: B023
            what="both ready",
        )
        await supervisor.stop(grace_s=10, finishing=finishing)
        assert (trainer.last_exit_code, trainer.state) == (code, state), finishing
        assert polite.last_exit_code == 0, "the others are stopped as before"


async def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    supervisor = Supervisor([ChildSpec("stubborn", [PY, "-c", STUBBORN])], tmp_path)
    child = supervisor.children["stubborn"]
    await supervisor.start()
    await wait_for(lambda: "ready" in log_text(child), what="SIGTERM ignored")

    started = time.monotonic()
    await supervisor.stop(grace_s=0.5)
    took_s = time.monotonic() - started

    assert child.state == "killed" and child.last_exit_code == -signal.SIGKILL
    assert took_s >= 0.5, "SIGKILL only after the grace period"
    assert child.pid is not None and not is_alive(child.pid)


def test_the_live_view_fits_an_80_column_terminal(tmp_path: Path) -> None:
    """The common default terminal: one row per service, the step and its bar on one line,
    each service's detail on one line under the table (folded beside the other columns it
    took a dozen lines per service and pushed the progress off a 24-line screen)."""
    specs = [ChildSpec(name, [PY, "-c", "pass"]) for name in ALL_SERVICES]
    supervisor = Supervisor(specs, tmp_path)
    monitor = HealthMonitor({name: f"http://127.0.0.1:1/{name}" for name in ALL_SERVICES})
    monitor.records["trainer"].body = {"step": 7, "policy_version": 7, "reward_recent": 0.5}
    for name in ALL_SERVICES:  # running, not answering yet: what a starting run shows
        supervisor.children[name].state = "running"
        monitor.records[name].error = f"no answer from http://127.0.0.1:1/{name}: refused"
    console = Console(width=80, record=True, force_terminal=False)
    view = StatusView(
        LauncherLog(console), supervisor, monitor, "nats://x", tmp_path, bound=Bound(max_steps=12)
    )

    console.print(view.render())
    lines = console.export_text().splitlines()

    assert max(len(line) for line in lines) <= 80
    assert any(line.startswith("trainer step 7/12 ") and "58%" in line for line in lines), lines
    for name in ALL_SERVICES:
        assert sum(line.startswith(f"│ {name} ") for line in lines) == 1, lines
        details = [line for line in lines if line.startswith(f"{name}: no answer from")]
        assert len(details) == 1 and details[0].endswith(("refused", "…")), lines


# --- a whole run with stand-in services ----------------------------------------------------


def test_run_stops_at_max_trainer_steps_and_summarizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = LaunchOptions(
        run_dir=tmp_path / "run",
        max_trainer_steps=5,
        duration_s=60,
        commands=fake_commands(),
        stop_grace_s=5,
    )
    exit_code = run_local(options)

    summary = last_json_line(capsys.readouterr().out)
    assert exit_code == 0, summary
    assert summary["stop_reason"] == "max_trainer_steps"
    assert summary["trainer_step"] >= 5 and summary["trainer_reward_mean"] == 0.25
    assert summary["all_services_seen_healthy"]
    assert {s["final_status"] for s in summary["services"].values()} == {"stopped"}
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert not [pid for pid in recorded_pids(tmp_path / "run") if is_alive(pid)]


def test_a_trainer_that_finishes_between_two_health_checks_ends_the_run_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its steps done before any check saw it serving: it exits 0 at its step bound.
    commands = {**fake_commands(), "trainer": [PY, "-c", "import time; time.sleep(0.3)"]}
    options = LaunchOptions(
        run_dir=tmp_path / "run",
        max_trainer_steps=3,
        duration_s=60,
        commands=commands,
        stop_grace_s=5,
    )
    exit_code = run_local(options)

    summary = last_json_line(capsys.readouterr().out)
    assert exit_code == 0, summary
    assert summary["stop_reason"] == "max_trainer_steps"
    assert summary["services"]["trainer"]["exit"] == "exit 0"
    assert not [pid for pid in recorded_pids(tmp_path / "run") if is_alive(pid)]


def test_service_that_never_becomes_healthy_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = {**fake_commands(), "reward": [PY, "-c", CRASHER]}
    options = LaunchOptions(
        run_dir=tmp_path,
        duration_s=60,
        commands=commands,
        provision=False,
        backoff=Backoff(initial_s=0.05),
        max_restarts_unhealthy=2,
    )
    exit_code = run_local(options)

    summary = last_json_line(capsys.readouterr().out)
    assert exit_code == 3
    assert summary["stop_reason"] == "unhealthy"
    assert "reward never became healthy" in summary["error"]
    assert str(tmp_path / "logs" / "reward.log") in summary["error"]
    assert summary["services"]["reward"]["restarts"] == 2
    assert summary["services"]["trainer"]["final_status"] == "stopped"
    assert not [pid for pid in recorded_pids(tmp_path) if is_alive(pid)]


def test_service_command_that_cannot_start_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = {**fake_commands(), "env-gateway": [str(tmp_path / "no-such-program")]}
    exit_code = run_local(LaunchOptions(run_dir=tmp_path, commands=commands, provision=False))

    summary = last_json_line(capsys.readouterr().out)
    assert exit_code == 3 and "no-such-program" in summary["error"]
    assert not [pid for pid in recorded_pids(tmp_path) if is_alive(pid)]


LAUNCH_WITH_FAKES = """
import sys
import threading
from pathlib import Path
from apps.launcher.run import LaunchOptions, run_local
sys.exit(run_local(LaunchOptions(run_dir=Path(sys.argv[1]), commands={commands!r},
                                 stop_grace_s={grace_s})))
"""


@pytest.fixture
def launcher_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Starts the launcher with stand-in services in a subprocess; kills it if a test fails."""
    started: list[subprocess.Popen[str]] = []

    def start(commands: dict[str, list[str]], grace_s: float = 5) -> subprocess.Popen[str]:
        code = LAUNCH_WITH_FAKES.format(commands=commands, grace_s=grace_s)
        process = subprocess.Popen(
            [PY, "-c", code, str(tmp_path)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()
    kill_leftovers(tmp_path)


def wait_all_serving(run_dir: Path) -> None:
    """Until every stand-in has set up its SIGTERM handling (the stubborn one says "ready")."""

    def serving(name: str) -> bool:
        log = run_dir / "logs" / f"{name}.log"
        return log.exists() and ("serving" in log.read_text() or "ready" in log.read_text())

    wait_until(
        lambda: all(serving(name) for name in ALL_SERVICES),
        timeout_s=120,
        what="every service serving",
    )


@E2E
def test_sigterm_to_launcher_stops_everything_cleanly(
    tmp_path: Path, launcher_process: Callable[..., subprocess.Popen[str]]
) -> None:
    process = launcher_process(fake_commands())
    wait_all_serving(tmp_path)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)

    summary = last_json_line(stdout)
    assert process.returncode == 0, stderr
    assert summary["stop_reason"] == "signal"
    assert not [pid for pid in recorded_pids(tmp_path) if is_alive(pid)]


@E2E
def test_services_stop_when_the_launcher_is_killed_outright(
    tmp_path: Path, launcher_process: Callable[..., subprocess.Popen[str]]
) -> None:
    process = launcher_process(fake_commands())
    wait_all_serving(tmp_path)
    services = [pid for pid in recorded_pids(tmp_path) if pid != process.pid]
    process.kill()  # no chance to stop anything itself
    process.wait()
    # The services get SIGTERM from the kernel when their parent dies (NATS keeps its own
    # session and is left for the next run's folder cleanup).
    wait_until(
        lambda: not [pid for pid in services if is_alive(pid) and not _is_nats(pid)],
        what="the services to stop after their launcher",
    )


def _is_nats(pid: int) -> bool:
    try:
        return "nats-server" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


@E2E
def test_second_ctrl_c_kills_what_ignores_sigterm(
    tmp_path: Path, launcher_process: Callable[..., subprocess.Popen[str]]
) -> None:
    commands = {**fake_commands(), "reward": [PY, "-c", STUBBORN]}
    process = launcher_process(commands, grace_s=60)
    wait_all_serving(tmp_path)
    process.send_signal(signal.SIGINT)
    trainer_pids = json.loads((tmp_path / "pids.json").read_text())["services"]["trainer"]
    wait_until(
        lambda: not any(is_alive(pid) for pid in trainer_pids),
        what="the polite services to stop after the first Ctrl-C",
    )
    process.send_signal(signal.SIGINT)
    stdout, _ = process.communicate(timeout=120)

    summary = last_json_line(stdout)
    assert process.returncode == 130
    assert summary["services"]["reward"]["final_status"] == "killed"
    assert not [pid for pid in recorded_pids(tmp_path) if is_alive(pid)]


# --- end to end: `rlpipe demo` with the real services ---------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run folder whose recorded processes are killed at teardown if the launcher leaked any
    (the test has already failed by then: it asserts none is alive)."""
    yield tmp_path / "run"
    kill_leftovers(tmp_path / "run")


@E2E
def test_demo_runs_every_service_and_leaves_nothing_behind(run_dir: Path) -> None:
    # A service slower to answer than the 30 s (torch imports, the model built, on a busy
    # machine) gets the rest of its health deadline before the run ends.
    result = subprocess.run(
        [PY, "-m", "apps.cli", "demo", "--duration-s", "30", "--run-dir", str(run_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json_line(result.stdout)
    assert summary["run_dir"] == str(run_dir.resolve())
    assert summary["stop_reason"] == "duration" and summary["duration_s"] >= 30
    unhealthy = [name for name, s in summary["services"].items() if not s["ever_healthy"]]
    assert set(summary["services"]) == set(ALL_SERVICES) and not unhealthy
    assert not [pid for pid in recorded_pids(run_dir) if is_alive(pid)]


def run_demo_to_steps(run_dir: Path, steps: int, *flags: str) -> dict[str, Any]:
    """`rlpipe demo --max-trainer-steps STEPS FLAGS...`: its summary, once it exited 0."""
    result = subprocess.run(
        [PY, "-m", "apps.cli", "demo", "--max-trainer-steps", str(steps), *flags,
         "--run-dir", str(run_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json_line(result.stdout)


@E2E
def test_demo_with_two_rollout_workers_shares_the_work_between_them(run_dir: Path) -> None:
    summary = run_demo_to_steps(run_dir, 20, "--rollout-workers", "2")

    assert summary["stop_reason"] == "max_trainer_steps"
    workers = {"rollout-worker", "rollout-worker-2"}
    assert set(summary["services"]) == set(ALL_SERVICES) | workers
    for name in workers:
        worker = summary["services"][name]
        assert worker["ever_healthy"] and worker["final_status"] == "stopped", (name, worker)
        assert worker["rollouts_published"] > 0, (name, worker)
    assert (run_dir / "logs" / "rollout-worker-2.log").is_file()
    assert not [pid for pid in recorded_pids(run_dir) if is_alive(pid)]


@E2E
def test_demo_over_tls_with_client_certificates_reaches_its_bound(run_dir: Path) -> None:
    summary = run_demo_to_steps(run_dir, 10, "--tls")

    assert summary["stop_reason"] == "max_trainer_steps" and summary["all_services_seen_healthy"]
    # Every service connected with the run's client certificate: the server took no other
    # (tests/test_nats_tls.py: a client without one is refused by such a server).
    server_log = (run_dir / "logs" / "nats-server.log").read_text()
    assert "TLS required for client connections" in server_log
    assert "verify: true" in (run_dir / "nats" / "nats.conf").read_text()
    made = {path.name for path in (run_dir / "tls").iterdir()}
    assert {"ca.pem", "client.pem", "client-key.pem"} <= made


@E2E
def test_demo_stops_cleanly_on_ctrl_c_once_every_service_is_up(run_dir: Path) -> None:
    process = subprocess.Popen(
        [PY, "-m", "apps.cli", "demo", "--run-dir", str(run_dir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 240
    for line in process.stderr:
        if '"event": "status"' in line and _all_services_up(json.loads(line)):
            break
        assert time.monotonic() < deadline, "services did not all come up within 240 s"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)  # a clean stop: 60 s grace per stage

    assert process.returncode == 0
    summary = last_json_line(stdout)
    not_stopped = {
        name: (s["final_status"], s["exit"])
        for name, s in summary["services"].items()
        if s["final_status"] != "stopped"
    }
    assert not not_stopped, f"{not_stopped}; launcher stderr: {stderr[-3000:]}"
    assert not [pid for pid in recorded_pids(run_dir) if is_alive(pid)]


def _all_services_up(status: dict[str, Any]) -> bool:
    states = status.get("services", {})
    return set(states) == set(ALL_SERVICES) and all(v in ("ok", "idle") for v in states.values())


def test_a_health_answer_from_another_service_on_the_port_is_not_taken_as_healthy() -> None:
    """The feedback API answering on env-gateway's port (a port drawn for both) must not pass
    for a healthy gateway: whoever answers must be the service expected."""

    class Answer(BaseHTTPRequestHandler):
        service = "feedback-ingester"

        def do_GET(self) -> None:
            data = json.dumps({"service": self.service, "status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        monitor = HealthMonitor({"env-gateway": url}, services={"env-gateway": "env-gateway"})
        asyncio.run(monitor.poll_once({"env-gateway": 1}))
        record = monitor.records["env-gateway"]
        assert record.status == "unreachable" and not record.ever_healthy
        assert record.detail == (
            f"{url} answers as 'feedback-ingester', not env-gateway: another process holds the port"
        )
        Answer.service = "env_gateway"  # the package's spelling is the same service
        asyncio.run(monitor.poll_once({"env-gateway": 1}))
        assert record.status == "ok" and record.ever_healthy
    finally:
        server.shutdown()
