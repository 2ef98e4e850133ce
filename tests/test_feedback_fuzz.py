"""Property-based fuzzing of the running feedback API from its served OpenAPI document.

Schemathesis generates valid and invalid requests for every operation (>= 1,000 cases in
all) against the real service process on a real nats-server; no response may be a 5xx,
use an undocumented status or content type, or break its documented schema. About a minute
on 2 cores; skip it locally with `-m "not fuzz"` (`make test` runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from libs.feedback.auth import ApiKeyEntry, hash_key
from libs.nats_server import NatsServer, free_port

pytestmark = pytest.mark.fuzz

KEY = "rlfb_fuzz-key-0123456789"
MIN_CASES = 1000
# Examples per (operation, mode); GET operations without parameters have one case each.
EXAMPLES = {GenerationMode.POSITIVE: 300, GenerationMode.NEGATIVE: 260}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api_url(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real feedback-ingester process, with a key for every product and no rate limit."""
    port = free_port()
    key = ApiKeyEntry(name="fuzz", sha256=hash_key(KEY), products=["*"])
    env = {
        **os.environ,
        "RLPIPE_NATS_URL": nats_server.url,
        "RLPIPE_FEEDBACK_INGESTER_HTTP_PORT": str(free_port()),
        "RLPIPE_FEEDBACK_INGESTER_API_PORT": str(port),
        "RLPIPE_FEEDBACK_INGESTER_API_KEYS": json.dumps([key.model_dump()]),
        "RLPIPE_FEEDBACK_INGESTER_RATE_PER_S": "1000000",
        "RLPIPE_FEEDBACK_INGESTER_RATE_BURST_EVENTS": "1000000",
        "RLPIPE_FEEDBACK_INGESTER_ROLE": "api",
        "RLPIPE_RUN_DIR": str(tmp_path_factory.mktemp("fuzz")),
        "RLPIPE_LOG_LEVEL": "warning",
    }
    log_path = tmp_path_factory.mktemp("fuzz-log") / "ingester.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.feedback_ingester"], env=env, stderr=log, stdout=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log_path)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the ingester did not come up; log: {log_path.read_text()[-3000:]}")


def test_fuzzing_the_served_openapi_document_finds_no_5xx_and_no_schema_breaks(
    api_url: str,
) -> None:
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    num_cases: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # Err raises on .ok()
        for mode, examples in EXAMPLES.items():
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # nothing to make invalid: no parameters, no body
            label = f"{operation.label} [{mode.value}]"
            num_cases[label] = fuzz_operation(api_url, operation, mode, examples)
    total = sum(num_cases.values())
    print(f"schemathesis cases: {total}: {num_cases}")
    assert total >= MIN_CASES, num_cases


def fuzz_operation(
    api_url: str, operation: schemathesis.APIOperation, mode: GenerationMode, examples: int
) -> int:
    """Run up to `examples` generated cases of one operation; returns how many ran."""
    headers = {"Authorization": f"Bearer {KEY}"}
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
    ran = [0]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        ran[0] += 1
        response = case.call(base_url=api_url, headers=headers, timeout=10)
        case.validate_response(response, checks=checks)

    run()
    return ran[0]
