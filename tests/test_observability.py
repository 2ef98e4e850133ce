"""The observability profile: Prometheus scrapes every service, Grafana draws the dashboard.

No Docker engine runs here, so these check the wiring through the resolved compose file:
the scrape config names every rlpipe service on the port its /metrics is served on, each
container gets the files it is configured to read, and the dashboard's queries use the data
source Grafana is provisioned with. That the queried metrics exist is checked on running
services in tests/test_compose_up.py.

Run: .venv/bin/python -m pytest tests/test_observability.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose_support import ROOT, Config, health_port, mounts, resolve_compose

PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "rlpipe.json"
# What the issue asked the dashboard to show, as words its panel titles use.
TOPICS = ("reward", "staleness", "throughput", "busy", "swap pause", "mismatch", "queue", "dead")


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return resolve_compose(tmp_path_factory.mktemp("compose"), "observability", "gpu")


def rlpipe_services(compose: Config) -> list[str]:
    """The long-running rlpipe services: not the one-shot commands run before them
    (`provision`, `weights-keys`), which serve no metrics and have their health check off
    (`disable: true`, which the resolved file writes as the test ["NONE"])."""
    return [
        n
        for n, s in compose["services"].items()
        if s.get("image", "").startswith("rlpipe") and not _health_check_off(s)
    ]


def _health_check_off(service: Config) -> bool:
    check = service.get("healthcheck", {})
    return bool(check.get("disable")) or check.get("test") == ["NONE"]


def mounted_at(service: Config, host_path: Path) -> str:
    """The container path `host_path` is bind-mounted at (fails when it is not)."""
    for source, target in mounts(service):
        if Path(source).resolve() == host_path.resolve():
            return target
    raise AssertionError(f"{host_path.relative_to(ROOT)} is not mounted: {mounts(service)}")


def test_observability_services_start_only_in_their_profile(compose: Config) -> None:
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["observability"], name


def test_prometheus_scrapes_every_rlpipe_service_on_its_metrics_port(compose: Config) -> None:
    prometheus = compose["services"]["prometheus"]
    target = mounted_at(prometheus, PROMETHEUS_CONFIG)
    assert f"--config.file={target}" in prometheus["command"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    scraped = {
        name: sd["port"]
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name in rlpipe_services(compose):
        port = health_port(compose["services"][name])
        assert scraped.get(name) == port, f"{name} serves /metrics on {port}; scraped: {scraped}"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose: Config) -> None:
    grafana = compose["services"]["grafana"]
    provisioning = mounted_at(grafana, GRAFANA_DIR / "provisioning")
    assert provisioning == "/etc/grafana/provisioning", "Grafana reads provisioning there"
    dashboards_at = mounted_at(grafana, GRAFANA_DIR / "dashboards")
    providers = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/rlpipe.yaml").read_text())
    assert providers["providers"][0]["options"]["path"] == dashboards_at
    sources = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/prometheus.yaml").read_text())
    source = sources["datasources"][0]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1].split("/")[0]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    for panel in dashboard_panels():
        uids = {panel["datasource"]["uid"]} | {t["datasource"]["uid"] for t in panel["targets"]}
        assert uids == {source["uid"]}, f"panel {panel['title']!r} reads {uids}"


def dashboard_panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return panels


def test_the_dashboard_covers_what_operators_watch() -> None:
    titles = " | ".join(panel["title"].lower() for panel in dashboard_panels())
    missing = [topic for topic in TOPICS if topic not in titles]
    assert not missing, f"no panel for {missing}: {titles}"
    for panel in dashboard_panels():
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel
