"""Shared fixtures: a real nats-server per test session, and a clean bus per test."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from libs.bus.connection import Bus, connect_bus
from libs.nats_server import NatsServer
from libs.policy import PolicyConfig, build_policy, load_policy_tokenizer, tokenizer_spec
from libs.policy_identity import describe_policy, store_identity
from tests.signing_support import signing_environment

# Services sign and verify weight versions with the session's key pair, as deployed.
for _name, _value in signing_environment().items():
    os.environ.setdefault(_name, _value)

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    import torch

    # Two workers on two cores (make test): one torch thread each. With torch's default of one
    # per core, the workers' thread pools spin against each other and the services the tests
    # start: the SFT resume test took 70-140 s with 2 threads, 4.5 s with 1 (2-core VM). The
    # services started as subprocesses keep their own default.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server with JetStream on a free port and its own store folder."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """A connection to a bus with no streams left over from earlier tests."""
    if nats_server.process is None or nats_server.process.poll() is not None:
        nats_server.start()  # a test that stopped the server and failed before restarting it
    connection = await connect_bus(nats_server.url, name="pytest")
    for info in await connection.js.streams_info():
        assert info.config.name is not None
        await connection.js.delete_stream(info.config.name)
    yield connection
    if not connection.nc.is_closed:
        await connection.nc.close()


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 60.0, what: str = ""
) -> None:
    """Poll `condition` until true; fail the test with `what` after `timeout_s` (a deadline
    against a hung test only: generous, for a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or condition}")


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


async def state_trainer_policy(js: JetStreamContext, policy: PolicyConfig | None = None) -> None:
    """Store the PolicyIdentity a trainer of `policy` would, for tests that stage weights
    themselves: a rollout-worker applies none before it has checked the trainer's policy."""
    policy = policy or PolicyConfig(device="cpu")
    model = build_policy(policy)
    tokenizer = load_policy_tokenizer(policy)
    identity = describe_policy(model.config, model.state_dict(), tokenizer, tokenizer_spec(policy))
    await store_identity(js, identity)
