"""Poison on every consumed subject of a running `rlpipe demo`: each message dead-lettered
with a reason by the service that consumes it, no service restarted, training going on.

The cases (tests/poison_support.py): random bytes, wrong schemas, missing fields, oversized
payloads and semantically invalid values (versions, token ids, lengths, names) on tasks, raw
and scored rollouts, staged weights, both announcement subjects, served generations,
feedback events and online samples. The demo runs with a small share of online steps so the
trainer reads the online stream too. A payload over the server's limit is refused at
publish and never stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js.errors import NotFoundError

from libs.bus import wire
from libs.bus.connection import connect_bus
from libs.nats_server import MAX_PAYLOAD_BYTES
from proto import streams, subjects
from proto.messages import DeadLetter
from tests.chaos_support import read_steps
from tests.marks import E2E
from tests.poison_support import Poison, poison_cases

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPECTED_REASONS = {
    "random_bytes": {"undecodable", "invalid"},
    "wrong_schema": {"schema_mismatch", "invalid"},
    "missing_fields": {"invalid"},
    "oversized": {"invalid", "rejected"},
    # A weight announcement whose values pass the checks is still unsigned (signing.py).
    "invalid_values": {"invalid", "rejected", "unsigned"},
}


def nats_url(stdout_path: Path) -> str | None:
    for line in stdout_path.read_text().splitlines():
        if '"nats started"' in line:
            return str(json.loads(line)["url"])
    return None


def num_steps(run_dir: Path) -> int:
    return max((r["step"] for r in read_steps(run_dir)), default=0)


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def publish(url: str, cases: list[Poison]) -> list[tuple[Poison, str, int]]:
    """Publish every case; (case, stream, sequence) of each stored one."""
    bus = await connect_bus(url, name="poisoner")
    try:
        stored = []
        for case in cases:
            ack = await bus.js.publish(case.subject, case.payload, headers=case.headers, timeout=10)
            stored.append((case, ack.stream, ack.seq))
        return stored
    finally:
        await bus.close()


async def publish_over_limit(url: str) -> str:
    bus = await connect_bus(url, name="poisoner")
    try:
        await bus.js.publish(subjects.ROLLOUTS_SCORED, b"\0" * (MAX_PAYLOAD_BYTES + 1))
    except nats.errors.MaxPayloadError as exc:
        return repr(exc)
    finally:
        await bus.close()
    return "stored"


async def dead_letters(url: str) -> dict[tuple[str, int], DeadLetter]:
    bus = await connect_bus(url, name="poison-check")
    try:
        info = await bus.js.stream_info(streams.DEAD_LETTERS.name)
        found: dict[tuple[str, int], DeadLetter] = {}
        if info.state.messages == 0:
            return found
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                raw = await bus.js.get_msg(streams.DEAD_LETTERS.name, seq=seq)
            except NotFoundError:
                continue
            letter = wire.decode(DeadLetter, raw.data or b"", raw.headers)
            found[(letter.origin_stream, letter.stream_sequence)] = letter
        return found
    finally:
        await bus.close()


@pytest.mark.timeout(420)
@E2E
def test_every_poison_message_is_dead_lettered_and_training_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stdout_path = run_dir / "demo.stdout"
    env = {
        **os.environ,
        "RLPIPE_TRAINER_ONLINE_FRACTION": "0.05",
        "RLPIPE_TRAINER_ONLINE_STREAM_WAIT_S": "0",
    }
    with stdout_path.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "apps.cli",
                "demo",
                "--run-dir",
                str(run_dir),
                "--duration-s",
                "330",
                # Poison as a compromised producer would send it, on every consumed subject:
                # the open bus lets one client play every producer (who may publish what is
                # tests/test_bus_permissions.py's matter).
                "--open-bus",
            ],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_until(lambda: num_steps(run_dir) >= 5, 180, "five trainer steps")
        url = nats_url(stdout_path)
        assert url is not None
        cases = poison_cases()
        stored = asyncio.run(publish(url, cases))
        over_limit = asyncio.run(publish_over_limit(url))
        steps_at_poison = num_steps(run_dir)

        letters: dict[tuple[str, int], DeadLetter] = {}

        def all_dead_lettered() -> bool:
            letters.update(asyncio.run(dead_letters(url)))
            return all((stream, seq) in letters for _, stream, seq in stored)

        wait_until(all_dead_lettered, 120, "every poison message dead-lettered")
        wait_until(lambda: num_steps(run_dir) >= steps_at_poison + 10, 120, "ten more steps")
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    outcomes = []
    for case, stream, seq in stored:
        letter = letters[(stream, seq)]
        outcomes.append((case.subject, case.kind, case.what, letter.reason, letter.consumer))
        assert letter.reason in EXPECTED_REASONS[case.kind], (case.what, letter.error)
        assert letter.consumer == case.refuser, (case.what, letter.consumer)
        assert letter.error, case.what
    (tmp_path / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    assert "MaxPayload" in over_limit
    summary = json.loads((run_dir / "summary.json").read_text())
    assert process.returncode == 0, summary
    restarted = {name: s["restarts"] for name, s in summary["services"].items() if s["restarts"]}
    assert not restarted, f"poison restarted services: {restarted}"
