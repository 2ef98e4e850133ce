"""Health that tells the truth: a service whose core work keeps failing says so on /healthz.

The watches (libs/work_health.py) against hand-made timelines, and the user's case from issue
15 through the real command: a weight-broadcaster that does not share the trainer's staging
folder answers 503 with the reason within a minute, and recovers once a version works.

Run: .venv/bin/python -m pytest tests/test_work_health.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.engine.hf import HFEngine
from libs.nats_server import NatsServer, free_port
from libs.policy import PolicyConfig, build_policy
from libs.rollout import weights_follower
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.weights_follower import WeightsFollower
from libs.tokenizer import ByteTokenizer
from libs.weights.handoff import stage_weights
from libs.weights.receiver import WeightReceiver
from libs.work_health import FailureWatch, LagWatch
from proto import streams
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.compose_support import http_get
from tests.conftest import wait_for
from tests.signing_support import signing_environment, trusting

UNHEALTHY_WITHIN_S = 60.0


def test_a_failure_watch_reports_from_the_first_failure_until_a_success() -> None:
    watch = FailureWatch("broadcasting staged versions")
    assert watch.problem() is None
    watch.failed("version 0: staged file x does not exist")
    watch.failed("version 1: staged file y does not exist")
    problem = watch.problem()
    assert problem is not None
    assert problem.startswith("broadcasting staged versions failing for 0 s (2 attempts)")
    assert problem.endswith("version 1: staged file y does not exist")
    watch.succeeded()
    assert watch.problem() is None


def test_a_lag_watch_reports_only_after_the_limit_behind_an_available_version() -> None:
    watch = LagWatch("weights", limit_s=60.0)
    watch.observe(held=None, available=None, now_s=0.0)
    assert watch.problem(now_s=1000.0) is None, "nothing announced: nothing to be behind"
    watch.observe(held=None, available=3, now_s=10.0)
    watch.observe(held=None, available=4, now_s=50.0)
    assert watch.problem(now_s=70.0) is None
    assert watch.problem(now_s=71.0) == (
        "no new weights for 61 s while version 4 is available (holding none)"
    )


def test_a_lag_watch_restarts_its_clock_when_a_version_is_taken() -> None:
    watch = LagWatch("weights", limit_s=60.0)
    watch.observe(held=None, available=3, now_s=0.0)
    watch.observe(held=3, available=5, now_s=50.0)  # took one: progress, clock restarts
    assert watch.problem(now_s=100.0) is None
    assert "holding version 3" in (watch.problem(now_s=111.0) or "")
    watch.observe(held=5, available=5, now_s=112.0)  # caught up
    assert watch.problem(now_s=1000.0) is None


@pytest.fixture
def broadcaster(nats_server: NatsServer, bus: Bus, tmp_path: Path) -> Iterator[str]:
    """`rlpipe run weight-broadcaster` with its own run folder; yields its /healthz URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")} | {
        **signing_environment(),
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_WEIGHT_BROADCASTER_RUN_DIR": str(tmp_path / "broadcaster"),
        "RLPIPE_WEIGHT_BROADCASTER_HTTP_PORT": str(port),
    }
    log = open(tmp_path / "broadcaster.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "apps.cli", "run", "weight-broadcaster"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}/healthz"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def health(url: str) -> tuple[int, dict[str, object]]:
    status, body = http_get(url)
    return status, json.loads(body) if body else {}


async def test_a_broadcaster_that_cannot_read_staged_weights_is_unhealthy_with_the_reason(
    broadcaster: str, bus: Bus, tmp_path: Path
) -> None:
    await wait_for(lambda: health(broadcaster)[0] == 200, 60.0, "the broadcaster is up")
    publisher = Publisher(bus.js)
    state = {"w": torch.arange(16, dtype=torch.float32)}
    # The trainer stages in a folder the broadcaster does not share (compose.yaml before
    # issue 15): the message arrives, the file does not.
    await stage_weights(publisher, tmp_path / "trainer" / "weights-staging", state, 0)
    staged_at = time.monotonic()
    await wait_for(
        lambda: health(broadcaster)[0] == 503, UNHEALTHY_WITHIN_S, "/healthz answers 503"
    )
    print(f"unhealthy {time.monotonic() - staged_at:.1f} s after the version was staged")
    report = health(broadcaster)[1]
    assert report["status"] == "failing"
    assert "version 0" in str(report["detail"])
    assert "is the staging folder shared?" in str(report["detail"])

    # Staged where the broadcaster reads, the next version goes out and health returns.
    await stage_weights(publisher, tmp_path / "broadcaster" / "weights-staging", state, 1)
    await wait_for(lambda: health(broadcaster)[0] == 200, 30.0, "/healthz answers 200 again")
    assert health(broadcaster)[1]["latest_version"] == 1


async def test_a_worker_that_cannot_get_an_announced_version_says_why(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 0 is announced but its chunks are gone: after the stall limit (shortened
    here from minutes) the follower names the version, what it holds and the last failure,
    which the rollout-worker's /healthz reports as "failing"."""
    monkeypatch.setattr(weights_follower, "WEIGHTS_STALL_S", 0.5)
    monkeypatch.setattr(weights_follower, "LAG_POLL_S", 0.05)
    await provision(bus.js)
    staging = tmp_path / "staging"
    broadcaster = WeightBroadcasterService(WeightBroadcasterSettings(staging_dir=staging))
    await broadcaster.start(bus)
    broadcasting = asyncio.create_task(broadcaster.run())
    model = build_policy(PolicyConfig(preset="tiny", seed=0))
    try:
        await stage_weights(Publisher(bus.js), staging, model.state_dict(), 0)
        await wait_for(lambda: broadcaster.health()["latest_version"] == 0, 30.0, "announced")
    finally:
        await broadcaster.stop()
        await asyncio.wait_for(broadcasting, timeout=10)
    await bus.js.purge_stream(streams.WEIGHT_CHUNKS.name)

    engine = HFEngine(build_policy(PolicyConfig(preset="tiny", seed=1)), ByteTokenizer())
    follower = WeightsFollower(
        engine,
        WeightReceiver(bus, trusting(fetch_timeout_s=2.0, decode_process=False)),
        GenerationBatcher(engine),
    )
    await follower.start(bus.js)
    following = asyncio.create_task(follower.run())
    try:
        await wait_for(lambda: "last failure" in (follower.problem() or ""), 30.0, "a problem")
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
    problem = follower.problem() or ""
    print(f"follower problem: {problem}")
    assert "while version 0 is available (holding none)" in problem, problem
    assert "last failure: MissingChunkError" in problem, problem
