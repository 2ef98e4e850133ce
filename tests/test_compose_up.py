"""`docker compose up`, run as local processes: the pipeline learns and weights reach workers.

tests/compose_support.py starts every service of compose.yaml's default profile as the
Docker engine would (its command and environment, its volumes only, its own ports) against
a nats-server started from the compose NATS config. The test then waits, as a user watching
`docker compose up` would, for three things: weights reach every rollout-worker replica, the
trainer's reward rises, and the workers follow the newer versions. On failure it prints every
container's state, /healthz and last log lines. The same running services then show that every
metric the Grafana dashboard (deploy/grafana/dashboards/rlpipe.json) queries is exported.

Run: .venv/bin/python -m pytest tests/test_compose_up.py -q
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.compose_support import ROOT, ComposeProcesses, Container, resolve_compose
from tests.marks import E2E

pytestmark = E2E

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rlpipe.json"

# On 2 shared cores: the nine processes import torch and start in about 30 s; the first
# weights reach the workers in seconds after that.
FIRST_WEIGHTS_S = 90.0
LEARN_S = 300.0
NUM_FIRST_STEPS = 5
NUM_LAST_STEPS = 10
# The built-in task (arith, difficulty 0) starts near 0.1 and is learned past 0.8.
LEARNED_REWARD = 0.6
MIN_RISE = 0.3


def rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


def dashboard_metrics() -> set[str]:
    """Names of the metrics the Grafana dashboard's queries read."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\brlpipe_[a-z0-9_]+", expr)}


def exported_metrics(text: str) -> list[tuple[str, bool]]:
    """(name, has samples) of every series name a /metrics page exports, including each
    family's sample names (_total, _bucket, _sum, _count) even before a labelled child
    exists."""
    found = []
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names = {family.name, *(family.name + s for s in suffixes.get(family.type, []))}
        sampled = {sample.name for sample in family.samples}
        found += [(name, name in sampled or family.name in sampled) for name in names | sampled]
    return found


def scraped_metrics(compose: ComposeProcesses) -> dict[str, set[str]]:
    """Metric name -> the containers whose /metrics export it (marked when no sample yet)."""
    exported: dict[str, set[str]] = {}
    names = [n for n in compose.names if n != "nats" and not compose.one_shot(n)]
    services = [c for name in names for c in compose.containers[name]]
    for container in services:
        for metric, has_samples in exported_metrics(compose.metrics(container)):
            mark = "" if has_samples else " (no samples yet)"
            exported.setdefault(metric, set()).add(container.name + mark)
    return exported


def rewards(compose: ComposeProcesses) -> list[float]:
    """The trainer's mean reward per step, from its steps log on the runs volume."""
    trainer = compose.containers["trainer"][0]
    path = (
        trainer.host_path(trainer.definition["environment"]["RLPIPE_TRAINER_RUN_DIR"]) / "trainer"
    )
    steps = path / "steps.jsonl"
    if not steps.exists():
        return []
    lines = steps.read_text().splitlines()
    return [json.loads(line)["mean_reward"] for line in lines if line.strip()]


def worker_versions(compose: ComposeProcesses) -> dict[str, int | None]:
    return {w.name: compose.health(w).get("policy_version") for w in workers(compose)}


def workers(compose: ComposeProcesses) -> list[Container]:
    return compose.containers["rollout-worker"]


def fail(compose: ComposeProcesses, what: str) -> None:
    pytest.fail(f"{what}\n{compose.diagnosis()}", pytrace=False)


def wait_until(compose: ComposeProcesses, done: object, timeout_s: float, what: str) -> None:
    """Poll `done()` every second; fail with the diagnosis after `timeout_s`, when a
    container exits, or when a service's /healthz says its core work is failing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert callable(done)
        if done():
            return
        # One-shot services (provision) end by design; the rest must keep running.
        names = [n for n in compose.names if n != "nats" and not compose.one_shot(n)]
        services = [c for n in names for c in compose.containers[n]]
        exited = [c.name for c in services + compose.containers["nats"] if not c.running]
        if exited:
            fail(compose, f"{', '.join(exited)} exited while waiting until {what}")
        failing = [(c.name, compose.health(c)) for c in services]
        failing = [(name, h["detail"]) for name, h in failing if h.get("status") == "failing"]
        if failing:
            fail(compose, f"failing while waiting until {what}: {failing}")
        time.sleep(1.0)
    fail(compose, f"not done after {timeout_s:.0f} s: {what}")


def learned(curve: list[float]) -> bool:
    if len(curve) < NUM_FIRST_STEPS + NUM_LAST_STEPS:
        return False
    first = sum(curve[:NUM_FIRST_STEPS]) / NUM_FIRST_STEPS
    last = sum(curve[-NUM_LAST_STEPS:]) / NUM_LAST_STEPS
    return last >= LEARNED_REWARD and last - first >= MIN_RISE


@pytest.fixture(scope="module")
def compose_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeProcesses]:
    """`docker compose up` of the default profile, as processes, for this module's tests."""
    tmp_path = tmp_path_factory.mktemp("compose-up")
    config = resolve_compose(tmp_path)
    started = time.monotonic()
    with ComposeProcesses(config, tmp_path / "compose") as compose:
        compose.up()
        print(f"\nservices started after {time.monotonic() - started:.0f} s: {compose.names}")
        yield compose


@pytest.mark.timeout(FIRST_WEIGHTS_S + LEARN_S + 120)
def test_compose_up_learns_and_delivers_weights_to_every_worker(
    compose_up: ComposeProcesses,
) -> None:
    compose, started = compose_up, time.monotonic()
    wait_until(
        compose,
        lambda: all(v is not None for v in worker_versions(compose).values()),
        FIRST_WEIGHTS_S,
        "weights reach every rollout-worker",
    )
    print(f"first weights on every worker after {time.monotonic() - started:.0f} s")
    wait_until(compose, lambda: learned(rewards(compose)), LEARN_S, "the reward rises")
    curve = rewards(compose)
    first, last = rounded(curve[:NUM_FIRST_STEPS]), rounded(curve[-NUM_LAST_STEPS:])
    print(f"learned after {time.monotonic() - started:.0f} s, {len(curve)} steps: ")
    print(f"  reward of the first steps {first}, of the last {last}")
    versions = worker_versions(compose)
    print(f"worker policy versions: {versions}")
    # The workers follow the trainer, not only its first version.
    assert all((v or 0) >= 1 for v in versions.values()), versions
    for worker in workers(compose):
        assert compose.health(worker)["weight_swaps"] >= 2, compose.health(worker)
    running = [name for name in compose.names if not compose.one_shot(name)]
    assert all(compose.healthy(name) for name in running), compose.diagnosis()


def test_every_metric_the_dashboard_draws_is_exported_by_a_running_service(
    compose_up: ComposeProcesses,
) -> None:
    """Scrapes every container's /metrics (what deploy/prometheus/prometheus.yml scrapes)."""
    exported = scraped_metrics(compose_up)
    queried = dashboard_metrics()
    missing = sorted(queried - set(exported))
    assert not missing, f"the dashboard queries metrics no service exports: {missing}"
    for metric in sorted(queried):
        print(f"{metric}: {sorted(exported[metric])}")
