"""The demo trains on while its rollout-worker's serve API is flooded (issue #31): `rlpipe
demo` with serve mode on reaches its step bound while 64 clients send n=16 requests at the
max_tokens cap, the worker keeps swapping weights, and the excess is refused with 429 (how
many steps a minute the flood costs is bench/serve_flood_bench.py's figure)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from libs.nats_server import free_port
from tests.marks import E2E

REPO_ROOT = Path(__file__).resolve().parent.parent
KEY = "flood-test-key"
STEPS = 40


class Flood:
    """`clients` connections, each sending the same long request as soon as answered
    (after Retry-After on a 429), from a thread of their own until `stop`."""

    def __init__(self, port: int, clients: int) -> None:
        body = json.dumps({"prompt": "12+30=", "n": 16, "max_tokens": 2048, "temperature": 2.0,
                           "stop": [f"stop-{i}" for i in range(16)]}).encode()  # fmt: skip
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.port, self.clients = port, clients
        self.statuses: Counter[int] = Counter()
        self.started_at: float | None = None  # Unix time of the first answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.clients)))

    async def _client(self) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:  # not listening yet
                await asyncio.sleep(0.5)
                continue
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while not self._stop.is_set():
                    await self._exchange(reader, writer)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(self.request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
        await reader.readexactly(int(headers.get("content-length") or 0))
        status = int(head[0].split()[1])
        self.statuses[status] += 1
        if status != 503 and self.started_at is None:
            self.started_at = datetime.now().timestamp()
        if status in (429, 503):
            await asyncio.sleep(float(headers.get("retry-after") or 1))


@E2E
def test_the_demo_trains_on_while_its_worker_serves_a_flood(tmp_path: Path) -> None:
    serve_port = free_port()
    env = os.environ | {
        "RLPIPE_ROLLOUT_WORKER_SERVE_PORT": str(serve_port),
        "RLPIPE_ROLLOUT_WORKER_SERVE_API_KEY": KEY,
    }
    command = [sys.executable, "-m", "apps.cli", "demo", "--open-bus",
               "--max-trainer-steps", str(STEPS), "--run-dir", str(tmp_path)]  # fmt: skip
    with Flood(serve_port, clients=64) as flood:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
        )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "max_trainer_steps"

    assert flood.started_at is not None, flood.statuses
    assert flood.statuses[429] > 0  # the excess is refused, not queued without bound
    assert not [status for status in flood.statuses if status >= 500 and status != 503]
    steps = _lines(tmp_path / "trainer" / "steps.jsonl")
    flooded_steps = [s for s in steps if s["time"] > flood.started_at]
    assert len(flooded_steps) >= STEPS // 2, (len(flooded_steps), flood.statuses)
    swaps = [e for e in _lines(tmp_path / "logs" / "rollout-worker.log")
             if e.get("event") == "weights swapped"
             and datetime.fromisoformat(e["timestamp"]).timestamp() > flood.started_at]  # fmt: skip
    assert len(swaps) >= STEPS // 4, len(swaps)


def _lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (a service log's other lines skipped)."""
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if line.startswith("{"):
                found.append(json.loads(line))
    return found
