"""A real service process on a real bus: health, metrics, config, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.health_server import HealthServer
from libs.nats_server import NatsServer, free_port
from services.trainer.settings import TrainerSettings


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http_ok(url: str, process: subprocess.Popen[str], timeout_s: float = 120) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"service exited early with {process.returncode}"
        try:
            status, body = http_get(url)
            if status == 200:
                return body
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


@pytest.fixture
def reward_service(
    nats_server: NatsServer, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_REWARD_HTTP_PORT": str(port),
        "RLPIPE_RUN_DIR": str(tmp_path),
        "RLPIPE_LOG_FORMAT": "json",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "apps.cli", "run", "reward"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield process, port
    if process.poll() is None:
        process.kill()
        process.wait()


def test_service_reports_health_and_metrics_then_drains_on_sigterm(
    reward_service: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = reward_service
    health = json.loads(wait_http_ok(f"http://127.0.0.1:{port}/healthz", process))
    assert health["service"] == "reward" and health["status"] == "ok"

    status, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert b'rlpipe_service_up{service="reward"} 1.0' in metrics
    assert http_get(f"http://127.0.0.1:{port}/nope")[0] == 404

    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-2000:]
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert all(e["service"] == "reward" for e in events)
    assert events[0]["event"] == "starting" and events[0]["settings"]["http_port"] == port
    assert events[-1]["event"] == "service stopped"


def test_service_with_an_unreachable_bus_exits_with_a_clear_error(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": url,
        "RLPIPE_TRAINER_HTTP_PORT": "0",
        "RLPIPE_TRAINER_CONNECT_ATTEMPTS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "services.trainer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"could not connect to NATS at {url}" in result.stderr


def test_settings_read_the_service_prefix_shared_fallbacks_and_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "rlpipe.toml"
    config.write_text('[trainer]\nhttp_port = 9999\nlog_level = "debug"\n[reward]\nhttp_port = 1\n')
    monkeypatch.setenv("RLPIPE_CONFIG", str(config))
    monkeypatch.setenv("RLPIPE_NATS_URL", "nats://shared:4222")
    monkeypatch.setenv("RLPIPE_TRAINER_LOG_LEVEL", "warning")

    settings = TrainerSettings()
    assert settings.nats_url == "nats://shared:4222"
    assert settings.http_port == 9999  # from the [trainer] table
    assert settings.log_level == "warning"  # the environment wins over the file

    monkeypatch.setenv("RLPIPE_TRAINER_NATS_URL", "nats://own:4222")
    assert TrainerSettings().nats_url == "nats://own:4222"


def test_a_bad_setting_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_TRAINER_HTTP_PORT", "not-a-port")
    with pytest.raises(ValueError, match="http_port"):
        TrainerSettings()


async def test_health_server_returns_503_while_unhealthy() -> None:
    state = {"service": "x", "status": "starting"}
    server = HealthServer(lambda: state, "127.0.0.1", 0)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/healthz"
        status, _ = await asyncio.to_thread(http_get, url)
        assert status == 503
        state["status"] = "ok"
        status, body = await asyncio.to_thread(http_get, url)
        assert status == 200 and json.loads(body)["status"] == "ok"
    finally:
        await server.stop()
