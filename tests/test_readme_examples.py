"""The docs' serve-mode and feedback examples, run as written on a fresh bus.

Each example's bash block is read from docs/serving.md and run by bash line for line, with only
what a test must change: the example's fixed ports (8000, 8080) become free ones, the
service started in the foreground goes to the background (the test then waits for its
health check), and RLPIPE_NATS_URL points at the test's nats-server. The answers are read
as a user would read them.

Run: .venv/bin/python -m pytest tests/test_readme_examples.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

from libs.nats_server import NatsServer, free_port
from tests.compose_support import ROOT

SERVING = ROOT / "docs" / "serving.md"


def bash_block(heading: str) -> list[str]:
    """Commands of the first ```bash block after `heading`, continuation lines joined."""
    text = SERVING.read_text()
    start = text.index(f"\n{heading}\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no bash block under {heading}"
    joined = block.group(1).replace("\\\n", " ")
    commands, pending = [], ""
    for line in joined.splitlines():  # a quoted JSON body may span lines
        pending = f"{pending}\n{line}" if pending else line
        if pending.count("'") % 2 == 0:
            commands.append(pending)
            pending = ""
    return [c for c in commands if c.strip()]


def script(commands: list[str], ports: dict[str, int], health_port: int) -> str:
    """The commands as one bash script: the `rlpipe run` line in the background until its
    health check answers 200, everything else as written."""
    lines = ["set -e"]
    for command in commands:
        for fixed, port in ports.items():
            command = re.sub(rf"\b{fixed}\b", str(port), command)
        if "rlpipe run" in command:
            lines.append(f"{re.sub(r'#.*$', '', command)} > service.log 2>&1 &")
            lines.append("echo $! > service.pid")
            lines.append(
                f"until curl -sf -o /dev/null http://127.0.0.1:{health_port}/healthz; do "
                "kill -0 $(cat service.pid) || exit 3; sleep 0.5; done"
            )
        else:
            lines.append(command)
    return "\n".join(lines) + "\n"


def run_example(
    heading: str, folder: Path, nats: NatsServer, ports: dict[str, int], service: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    health_port = free_port()
    (folder / ".venv").symlink_to(ROOT / ".venv")
    prefix = f"RLPIPE_{service.upper().replace('-', '_')}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {
        "RLPIPE_NATS_URL": nats.url,
        "RLPIPE_RUN_DIR": str(folder / "run"),
        f"{prefix}_HTTP_PORT": str(health_port),
    }
    text = script(bash_block(heading), ports, health_port)
    try:
        result = subprocess.run(
            ["bash", "-c", text], cwd=folder, env=env, capture_output=True, text=True, timeout=240
        )
    finally:
        stop_service(folder)
    return result, folder / "service.log"


def stop_service(folder: Path) -> None:
    pid_file = folder / "service.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def answer(result: subprocess.CompletedProcess[str], log: Path) -> dict[str, Any]:
    assert result.returncode == 0, (result.stderr[-2000:], log.read_text()[-3000:])
    body: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return body


def test_the_serve_example_answers_on_a_fresh_bus(tmp_path: Path, nats_server: NatsServer) -> None:
    result, log = run_example(
        "## Serve mode", tmp_path, nats_server, {"8000": free_port()}, "rollout-worker"
    )
    body = answer(result, log)
    assert body["model"] == "rlpipe-policy" and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["policy_version"] == 0  # the preset's random init, served at once
    assert choice["generation_id"] == body["id"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 16


def test_the_feedback_example_is_accepted(tmp_path: Path, nats_server: NatsServer) -> None:
    result, log = run_example(
        "### Posting feedback", tmp_path, nats_server, {"8080": free_port()}, "feedback-ingester"
    )
    body = answer(result, log)
    assert body["event_id"] == "ev-0001" and body["stream_seq"] >= 1
    key = (tmp_path / "shop.key").read_text().strip()
    assert key.startswith("rlfb_") and (tmp_path / "shop.key").stat().st_mode & 0o077 == 0


def test_the_key_tool_prints_what_the_variable_takes() -> None:
    result = subprocess.run(
        [
            str(ROOT / ".venv/bin/rlpipe"),
            "feedback-key",
            "--name",
            "shop",
            "--products",
            "shop,beta",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    from services.feedback_ingester.settings import FeedbackIngesterSettings

    entries = json.loads(result.stdout)
    settings = FeedbackIngesterSettings(api_keys=entries)
    assert [(e.name, e.products) for e in settings.api_keys] == [("shop", ["shop", "beta"])]
    assert result.stderr.startswith("key (shown once): rlfb_")
