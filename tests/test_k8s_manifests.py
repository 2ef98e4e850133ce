"""The Kubernetes manifests in deploy/k8s (hub and region), checked without a cluster.

Every object is validated against the Kubernetes API's JSON schemas by kubernetes-validate
(strict: an unknown field fails), which carries the schemas inside the package: the
validation runs with the network cut. On top of the schema, the facts a cluster would only
reveal at run time: each rlpipe container runs a real `rlpipe` command and is probed on the
/healthz of the port its settings serve on; the NATS configs are the repository's and
nats-server accepts them; the trainer and the weight-broadcaster share the staging folder;
secrets come from the overlay's generator; the region's services connect to the region's
server alone (docs/regions.md), the hub sources the region's outboxes, and the region's
workers scale on the hub's task backlog.

Run: .venv/bin/python -m pytest tests/test_k8s_manifests.py -q
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from apps.cli import build_parser
from libs.nats_server import find_nats_server
from proto import permissions
from proto.permissions import REGION_ROLES, ROLES, password_variable
from tests.compose_support import PASSWORDS, ROOT

K8S = ROOT / "deploy" / "k8s"
NATS_DIR = ROOT / "deploy" / "nats"
OVERLAYS = ("hub", "region")
# appArmorProfile and user-namespaced pods (env-gateway) need 1.30.
OLDEST_KUBERNETES = "1.30"
Manifest = dict[str, Any]


def manifests(overlay: str) -> list[tuple[str, Manifest]]:
    """(file name, object) of every object the overlay's kustomization applies."""
    kustomization = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((K8S / overlay / name).read_text()):
            if document:
                found.append((name, document))
    return found


def every_manifest() -> list[tuple[str, Manifest]]:
    return [(f"{o}/{n}", m) for o in OVERLAYS for n, m in manifests(o)]


def workloads(overlay: str) -> Iterator[tuple[Manifest, Manifest]]:
    """(pod spec, container) of every Deployment, StatefulSet and Job."""
    for _, manifest in manifests(overlay):
        if manifest["kind"] in {"Deployment", "StatefulSet", "Job"}:
            pod = manifest["spec"]["template"]["spec"]
            for container in pod["containers"]:
                yield pod, container


def rlpipe_containers(overlay: str) -> list[Manifest]:
    return [c for _, c in workloads(overlay) if c["image"].startswith("rlpipe")]


def env_values(container: Manifest) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def find(overlay: str, kind: str, name: str) -> Manifest:
    for _, manifest in manifests(overlay):
        if manifest["kind"] == kind and manifest["metadata"]["name"] == name:
            return manifest
    raise AssertionError(f"no {kind} {name} in deploy/k8s/{overlay}")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt fails the test: the validator must not download schemas."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access during validation: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, latest_version()])
@pytest.mark.usefixtures("no_network")
def test_every_manifest_is_valid_against_the_kubernetes_schemas_offline(version: str) -> None:
    checked = []
    for name, manifest in every_manifest():
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {manifest['kind']} {manifest['metadata']['name']}: {exc}")
        checked.append(manifest["kind"])
    assert {"StatefulSet", "Deployment", "HorizontalPodAutoscaler", "ConfigMap"} <= set(checked)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_kustomization_applies_every_manifest_of_its_folder(overlay: str) -> None:
    kustomization = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
    on_disk = {p.name for p in (K8S / overlay).glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_a_pod_needs_comes_from_the_overlays_generator(overlay: str) -> None:
    """The generated Secret holds every key a container reads (optional ones aside), and the
    example env file docs/deployment.md tells users to copy lists exactly those keys."""
    kustomization = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
    generated = {g["name"]: g.get("envs", g.get("files")) for g in kustomization["secretGenerator"]}
    example_keys = {
        line.split("=", 1)[0]
        for line in (K8S / overlay / "nats-users.env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    needed = set()
    for _, container in workloads(overlay):
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                assert ref["name"] in generated, f"{variable['name']}: no Secret {ref['name']}"
                needed.add(ref["key"])
    assert needed == example_keys, f"pods read {needed}; nats-users.env.example has {example_keys}"
    signing = {"rlpipe-weights-signing": ["weights-signing/weights-signing.key"]}
    assert generated == {"rlpipe-nats-users": ["nats-users.env"]} | (
        signing if overlay == "hub" else {}
    )
    assert "deploy/k8s/*/nats-users.env" in (ROOT / ".gitignore").read_text()
    assert "deploy/k8s/*/weights-signing/" in (ROOT / ".gitignore").read_text()


def test_the_trainers_pod_alone_holds_the_signing_key_and_region_workers_verify() -> None:
    """The weight-signing private key is mounted into the trainer and weight-broadcaster
    (one pod) and named by their settings; the region's workers and pruner get the public
    key (docs/weights.md, "Signing weight versions")."""
    holders = []
    for overlay in OVERLAYS:
        for pod, container in workloads(overlay):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            if "secret" in volumes.get("weights-signing", {}) and "weights-signing" in mounts:
                holders.append(container["name"])
    assert sorted(holders) == ["trainer", "weight-broadcaster"]
    names = {c["name"]: c for c in rlpipe_containers("hub")}
    assert env_values(names["weight-broadcaster"])["RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY"]
    assert env_values(names["trainer"])["RLPIPE_TRAINER_SAME_HOST_SIGNING_KEY"]
    for container in rlpipe_containers("region"):
        env = container.get("env", [])
        refs = {e["name"]: e.get("valueFrom", {}).get("configMapKeyRef") for e in env}
        signers = refs.get("RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS") or refs.get(
            "RLPIPE_WEIGHTS_SIGNERS"
        )
        if container["name"] in ("rollout-worker", "relay-prune"):
            assert signers == {"name": "rlpipe-weights-signers", "key": "weights-signing.pub"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rlpipe_container_runs_a_real_command(overlay: str) -> None:
    parser = build_parser()
    for container in rlpipe_containers(overlay):
        args = parser.parse_args(container["args"])  # exits (fails) on an unknown command
        assert args.command in {"run", "weights", "provision", "region"}, container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rlpipe_service_is_probed_on_its_healthz(overlay: str) -> None:
    services = [c for c in rlpipe_containers(overlay) if c["args"][0] == "run"]
    assert services
    for container in services:
        prefix = "RLPIPE_" + container["args"][1].upper().replace("-", "_")
        env = env_values(container)
        assert env[f"{prefix}_HTTP_HOST"] == "0.0.0.0", container["name"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            http = container[probe]["httpGet"]
            assert http["path"] == "/healthz", (container["name"], probe)
            assert str(ports[http["port"]]) == env[f"{prefix}_HTTP_PORT"], (
                container["name"],
                probe,
            )


def test_pods_never_share_a_port() -> None:
    for overlay in OVERLAYS:
        for _, manifest in manifests(overlay):
            if manifest["kind"] in {"Deployment", "StatefulSet"}:
                pod = manifest["spec"]["template"]["spec"]
                ports = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
                assert len(ports) == len(set(ports)), manifest["metadata"]["name"]


def test_the_broadcaster_reads_the_staging_folder_the_trainer_writes() -> None:
    """Same pod, same volume, same path: <trainer run dir>/weights-staging."""
    pod = find("hub", "StatefulSet", "trainer")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    trainer, broadcaster = containers["trainer"], containers["weight-broadcaster"]
    staging = env_values(broadcaster)["RLPIPE_WEIGHT_BROADCASTER_STAGING_DIR"]
    assert staging == env_values(trainer)["RLPIPE_TRAINER_RUN_DIR"] + "/weights-staging"

    def volume_of(container: Manifest, path: str) -> tuple[str, str]:
        mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mounts, f"{container['name']} mounts nothing at {path}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        return mount["name"], mount.get("subPath", "") + path[len(mount["mountPath"]) :]

    assert volume_of(trainer, staging) == volume_of(broadcaster, staging)


def config_map_files(overlay: str, name: str) -> dict[str, str]:
    data: dict[str, str] = find(overlay, "ConfigMap", name)["data"]
    return data


@pytest.mark.parametrize(
    ("overlay", "config_map", "config"),
    [
        ("hub", "rlpipe-nats-config", "hub-cluster.conf"),
        ("region", "rlpipe-nats-region-config", "region-leaf.conf"),
    ],
)
def test_nats_runs_the_repositorys_config_and_nats_server_accepts_it(
    overlay: str, config_map: str, config: str, tmp_path: Path
) -> None:
    files = config_map_files(overlay, config_map)
    for name, text in files.items():
        assert text == (NATS_DIR / name).read_text(), (
            f"{config_map}/{name} differs from deploy/nats"
        )
        (tmp_path / name).write_text(text)
    nats = next(c for _, c in workloads(overlay) if c["image"].startswith("nats:"))
    assert f"/etc/nats/rlpipe/{config}" in " ".join(nats["args"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")} | PASSWORDS
    env |= {password_variable(name, "region"): f"{name}Pw0" for name in REGION_ROLES}
    env["RLPIPE_NATS_LEAF_URL"] = "nats-leaf://leaf-region-a:pw@hub.example.internal:7422"
    env["RLPIPE_NATS_NODE_NAME"] = "nats-0"
    result = subprocess.run(
        [find_nats_server(), "-t", "-c", str(tmp_path / config)],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_hubs_bus_is_three_nodes_keeping_every_stream_and_fsyncing_every_write() -> None:
    """What an acknowledged message survives (docs/deployment.md, "What durable means"):
    a node's death (every stream on three nodes, R3) and a power loss (fsync before the ack)."""
    nats = find("hub", "StatefulSet", "nats")["spec"]
    provision = next(c for c in rlpipe_containers("hub") if c["args"][0] == "provision")
    replicas = int(env_values(provision)["RLPIPE_NATS_REPLICAS"])
    assert 3 <= replicas <= nats["replicas"]
    names = find("hub", "Service", nats["serviceName"])["spec"]
    assert names["clusterIP"] == "None" and names["publishNotReadyAddresses"]
    hub_files = config_map_files("hub", "rlpipe-nats-config")
    for index in range(nats["replicas"]):
        route = f"nats-route://nats-{index}.{nats['serviceName']}:6222"
        assert route in hub_files["hub-cluster.conf"], f"pod nats-{index} has no route"
    node_name = next(e for e in nats["template"]["spec"]["containers"][0]["env"]
                     if e["name"] == "RLPIPE_NATS_NODE_NAME")  # fmt: skip
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    region_files = config_map_files("region", "rlpipe-nats-region-config")
    # Each config with a jetstream block of its own (hub.conf's replaces nats.conf's).
    for name, text in [*hub_files.items(), *region_files.items()]:
        if re.search(r"^jetstream \{", text, re.M):
            assert re.search(r"^\s+sync_interval: always$", text, re.M), f"{name}: no sync policy"


def test_a_regions_services_connect_to_the_regions_server_alone() -> None:
    """Every rlpipe container of the region talks to the regional server as one of its users
    (docs/regions.md); the env-gateway takes tasks from the hub's queue; only the region's
    server links to the hub, through its leafnode port; the hub sources the region."""
    region_nats = find("region", "Service", "nats")["metadata"]["name"]
    for container in rlpipe_containers("region"):
        args, env = container["args"], env_values(container)
        url = urlsplit(env.get("RLPIPE_NATS_URL") or args[args.index("--nats-url") + 1])
        assert url.hostname == region_nats, container["name"]
        user = env.get("RLPIPE_NATS_USER") or url.username
        assert user in REGION_ROLES, (container["name"], user)
        assert env.get("RLPIPE_PROVISION", "false") == "false", container["name"]
    gateway = next(c for c in rlpipe_containers("region") if c["args"] == ["run", "env-gateway"])
    assert env_values(gateway)["RLPIPE_ENV_GATEWAY_FEEDER_MODE"] == "off"
    assert env_values(gateway)["RLPIPE_ENV_GATEWAY_INTAKE_HUB_DOMAIN"] == permissions.HUB_DOMAIN
    leaf_server = next(c for _, c in workloads("region") if c["image"].startswith("nats:"))
    leaf_url = urlsplit(env_values(leaf_server)["RLPIPE_NATS_LEAF_URL"])
    assert leaf_url.port == 7422 and leaf_url.username == f"leaf-{permissions.REGIONS[0]}"
    hub_ports = {p["port"] for p in find("hub", "Service", "nats-regions")["spec"]["ports"]}
    assert hub_ports == {7422}
    sources = next(c for c in rlpipe_containers("hub") if c["args"][:2] == ["region", "hub-setup"])
    assert sources["args"][sources["args"].index("--regions") + 1] == ",".join(permissions.REGIONS)


def test_region_workers_scale_on_the_hubs_task_backlog() -> None:
    hpa = find("region", "HorizontalPodAutoscaler", "rollout-worker")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rollout-worker",
    }
    [metric] = hpa["metrics"]
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {
        "stream_name": "RL_TASKS",
        "consumer_name": "rollout-worker",
    }
    exporter = next(c for _, c in workloads("hub") if "prometheus-nats-exporter" in c["image"])
    assert "-jsz=all" in exporter["args"], "the hub exports no consumer backlog"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespace_denies_ingress_but_what_it_names(overlay: str) -> None:
    policies = {m["metadata"]["name"]: m["spec"] for _, m in manifests(overlay)
                if m["kind"] == "NetworkPolicy"}  # fmt: skip
    deny = policies["default-deny-ingress"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny, "the default policy admits nothing"
    nats = policies["nats"]
    assert nats["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "nats"}}


def test_every_service_connects_as_its_role_and_only_the_provisioning_jobs_as_admin() -> None:
    users = {}
    for overlay in OVERLAYS:
        for container in rlpipe_containers(overlay):
            env = env_values(container)
            users[container["name"]] = env.get("RLPIPE_NATS_USER")
            if container["args"][0] == "run":
                service = container["args"][1].upper().replace("-", "_")
                switch = env.get(f"RLPIPE_{service}_PROVISION", env.get("RLPIPE_PROVISION", ""))
                assert str(switch).lower() == "false", container["name"]
    assert users["provision"] == "admin"
    # The hub's streams, and their sources of the regions' outboxes (docs/regions.md).
    assert [n for n, u in users.items() if u == "admin"] == ["provision", "region-sources"]
    for name in ("trainer", "weight-broadcaster", "reward", "env-gateway", "rollout-worker"):
        assert users[name] == name and name in ROLES
