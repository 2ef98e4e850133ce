"""compose.yaml run without Docker: every service of a profile as a local process.

No Docker engine runs where the suite runs, so `ComposeProcesses` plays the engine's part:

- the file is resolved by `docker-compose config` (anchors, merges, interpolation, defaults
  exactly as `up` resolves them);
- each container (a service, times its `deploy.replicas`) becomes one process running that
  service's `command` after the image's ENTRYPOINT (read from the Dockerfile; the nats image's
  is `nats-server`), with that service's `environment` over the image's ENV, in the image's
  WORKDIR;
- a container sees the filesystem only through the volumes it mounts: each named volume is a
  temporary folder of its own, a bind mount is its host folder, and every other container path
  lands in that container's private root folder. The harness rewrites container paths in the
  environment and the command through these mounts; the services are not told anything else;
- each container's network is private: a container port it exposes or publishes becomes a
  free host port, `0.0.0.0` becomes loopback, and a URL naming another service (`nats:4222`)
  is rewritten to that service's host port;
- `depends_on` is honoured in order, `service_healthy` by running the service's health check
  (its `http://127.0.0.1:PORT/...` probes, ports mapped), `service_completed_successfully`
  by waiting for the one-shot service's exit 0 (`provision`).

The NATS config names container facts inside its files: its store_dir is rewritten in a copy of
the mounted config folder (mapped through the volumes like any other path), and its ports are
given on the command line (flags win over the file).

Run: see tests/test_compose_up.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from libs.nats_server import find_nats_server, free_port
from proto.permissions import ROLES

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
VENV_BIN = Path(sys.executable).parent
# A `store_dir: <path>` line of a NATS config (the one container path NATS configs name).
STORE_DIR = r"^(\s*store_dir:\s*)(\S+)"
QUOTES = "\"'"

# The passwords compose requires, one per role (letters and digits, as SECURITY.md asks).
PASSWORDS = {
    role.password_variable: f"{role.name.replace('-', '')}Pw0test" for role in ROLES.values()
}

Config = dict[str, Any]


def run_compose_config(
    tmp_dir: Path,
    *profiles: str,
    passwords: dict[str, str] = PASSWORDS,
    compose_file: Path = COMPOSE_FILE,
) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """`docker-compose config` on a compose file with only `passwords` set, every other
    default left as shipped; the command (for messages) and its result."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(
            "docker-compose is not on PATH; `make test` installs it "
            "(or run: apt-get install -y docker-compose)",
            pytrace=False,
        )
    # The user's RLPIPE_* overrides and .env would change the result; test the defaults.
    empty_env_file = tmp_dir / "empty.env"
    empty_env_file.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLPIPE_", "COMPOSE_"))}
    env |= passwords
    command = [binary, "--project-directory", str(ROOT), "--env-file", str(empty_env_file)]
    command += ["-f", str(compose_file)]
    for profile in profiles:
        command += ["--profile", profile]
    result = subprocess.run(
        [*command, "config"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    return command, result


def resolve_compose(tmp_dir: Path, *profiles: str, compose_file: Path = COMPOSE_FILE) -> Config:
    """A compose file as `docker-compose config` resolves it, defaults left as shipped."""
    command, result = run_compose_config(tmp_dir, *profiles, compose_file=compose_file)
    if result.returncode != 0:
        pytest.fail(f"{shlex.join(command)} config failed:\n{result.stderr}", pytrace=False)
    config: Config = yaml.safe_load(result.stdout)
    return config


def started_services(config: Config, *profiles: str) -> list[str]:
    """Services `up` starts with these profiles active (compose v1's `config` does not filter)."""
    return [
        name
        for name, service in config["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)
    ]


def mounts(service: Config) -> list[tuple[str, str]]:
    """(source, target) of each volume, from v1's "src:dst:mode" strings or v2's mappings."""
    result = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            result.append((str(volume.get("source", "")), str(volume["target"])))
        else:
            source, target = volume.split(":")[:2]
            result.append((source, target))
    return result


def container_ports(service: Config) -> list[int]:
    """Ports the service's containers listen on: `expose` and the targets of `ports`."""
    ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
    for port in service.get("ports", []):
        target = (
            port["target"] if isinstance(port, dict) else str(port).split("/")[0].split(":")[-1]
        )
        ports.add(int(target))
    return sorted(ports)


def health_port(service: Config) -> int:
    """The container port the service's health check probes."""
    test = service.get("healthcheck", {}).get("test", [])
    match = re.search(r"127\.0\.0\.1:(\d+)/", " ".join(map(str, test)))
    assert match, f"no HTTP health check in {test}"
    return int(match.group(1))


# ---- the image -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """What a container gets from its image: entrypoint, environment, working folder."""

    entrypoint: tuple[str, ...]
    env: dict[str, str]
    workdir: str


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's last stage, continuations joined."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def rlpipe_image() -> Image:
    """The rlpipe image, from the Dockerfile: its PATH's venv is this interpreter's."""
    entrypoint: tuple[str, ...] = ()
    env: dict[str, str] = {}
    workdir = "/"
    for keyword, arguments in dockerfile_final_stage():
        if keyword == "ENTRYPOINT":
            entrypoint = tuple(json.loads(arguments))
        elif keyword == "WORKDIR":
            workdir = arguments
        elif keyword == "ENV":
            env |= dict(pair.split("=", 1) for pair in shlex.split(arguments))
    env["PATH"] = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"
    return Image(entrypoint, env, workdir)


def nats_image() -> Image:
    """The official nats image runs `nats-server` with the arguments given as command."""
    return Image((find_nats_server(),), {"PATH": "/usr/bin:/bin"}, "/")


# ---- one container as a process ------------------------------------------------------------


@dataclass
class Container:
    """One container of a service, as a local process."""

    service: str
    name: str
    definition: Config
    root: Path  # the container's private filesystem
    ports: dict[int, int]  # container port -> host port
    volume_dirs: dict[str, Path]  # named volume -> its folder
    log_path: Path
    # Bind mount sources this container sees as a translated copy instead (nats' config).
    binds: dict[str, Path] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    def host_path(self, container_path: str) -> Path:
        """Where `container_path` is for this container: through the longest mount that
        holds it, else in the container's own root."""
        path = container_path.rstrip("/") or "/"
        for source, target in sorted(mounts(self.definition), key=lambda m: -len(m[1])):
            target = target.rstrip("/") or "/"
            if path == target or path.startswith(target + "/"):
                base = self.volume_dirs.get(source) or self.binds.get(source) or Path(source)
                return base / path[len(target) :].lstrip("/")
        return self.root / path.lstrip("/")

    def url(self, container_port: int, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.ports[container_port]}{path}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, num_lines: int = 15) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


class ComposeProcesses:
    """The containers of the started services, as processes; `up`, then `down`."""

    def __init__(self, config: Config, work_dir: Path, *profiles: str) -> None:
        self.config = config
        self.work_dir = work_dir
        self.names = started_services(config, *profiles)
        self.volume_dirs = {name: work_dir / "volumes" / name for name in config.get("volumes", {})}
        self.containers: dict[str, list[Container]] = {}
        for name in self.names:
            definition = config["services"][name]
            replicas = int(definition.get("deploy", {}).get("replicas", 1))
            self.containers[name] = [
                self._container(name, definition, f"{name}-{i + 1}") for i in range(replicas)
            ]
        for containers in self.containers.values():
            for container in containers:
                self._prepare(container)

    def _container(self, service: str, definition: Config, name: str) -> Container:
        return Container(
            service=service,
            name=name,
            definition=definition,
            root=self.work_dir / "containers" / name,
            ports={port: free_port() for port in container_ports(definition)},
            volume_dirs=self.volume_dirs,
            log_path=self.work_dir / "logs" / f"{name}.log",
        )

    # ---- translation -----------------------------------------------------------------------

    def translate(self, container: Container, value: str) -> str:
        """A value as the process must see it: container paths, ports, hosts mapped."""
        if "://" in value:
            return self._translate_url(value)
        if value.startswith("/"):
            return str(container.host_path(value))
        if value == "0.0.0.0":
            return "127.0.0.1"  # the container's own interfaces: loopback here
        if value.isdigit() and int(value) in container.ports:
            return str(container.ports[int(value)])
        return value

    def _translate_url(self, url: str) -> str:
        parts = urlsplit(url)
        if parts.hostname not in self.containers or parts.port is None:
            return url
        target = self.containers[parts.hostname][0]
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"127.0.0.1:{target.ports[parts.port]}"
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc))

    def _prepare(self, container: Container) -> None:
        definition = container.definition
        is_nats = definition.get("image", "").startswith("nats:")
        image = nats_image() if is_nats else rlpipe_image()
        if is_nats:
            self._copy_nats_config(container)
        command = [self.translate(container, str(arg)) for arg in definition.get("command", [])]
        container.argv = [*image.entrypoint, *command]
        if container.argv and not container.argv[0].startswith("/"):
            found = shutil.which(container.argv[0], path=image.env["PATH"])
            assert found, f"{container.argv[0]} not on {image.env['PATH']}"
            container.argv[0] = found
        if is_nats:
            container.argv += self._nats_overrides(container)
        environment = {k: str(v) for k, v in (definition.get("environment") or {}).items()}
        container.env = image.env | {
            k: self.translate(container, v) for k, v in environment.items()
        }
        container.env["HOME"] = str(container.host_path(image.workdir))
        container.cwd = container.host_path(image.workdir)

    def _copy_nats_config(self, container: Container) -> None:
        """The mounted config folder, copied with its store_dir mapped through the volumes
        (the only container path the NATS config names)."""

        def mapped(match: re.Match[str]) -> str:
            return f'{match.group(1)}"{container.host_path(match.group(2).strip(QUOTES))}"'

        for source, target in mounts(container.definition):
            if source in self.volume_dirs or not Path(source).is_dir():
                continue
            copy = container.root / "binds" / target.strip("/")
            shutil.copytree(source, copy, dirs_exist_ok=True)
            for conf in copy.glob("*.conf"):
                conf.write_text(re.sub(STORE_DIR, mapped, conf.read_text(), flags=re.M))
            container.binds[source] = copy

    def _nats_overrides(self, container: Container) -> list[str]:
        """Listen address and ports: the container's network, given on the command line."""
        client = re.search(r"^port:\s*(\d+)", NATS_CONF.read_text(), re.M)
        monitor = re.search(r"^http_port:\s*(\d+)", NATS_CONF.read_text(), re.M)
        assert client and monitor, f"{NATS_CONF} sets no port or http_port"
        return [
            "--addr", "127.0.0.1",
            "--port", str(container.ports[int(client.group(1))]),
            "--http_port", str(container.ports[int(monitor.group(1))]),
        ]  # fmt: skip

    # ---- lifecycle ---------------------------------------------------------------------------

    def up(self, timeout_s: float = 120.0) -> None:
        """Start every container once what it depends on is started or healthy."""
        started: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while len(started) < len(self.names):
            ready = [n for n in self.names if n not in started and self._deps_met(n, started)]
            exited = [
                c.name
                for n in started
                for c in self.containers[n]
                if not c.running and not self._completed(n)
            ]
            if exited:
                raise AssertionError(f"{', '.join(exited)} exited:\n{self.diagnosis()}")
            if not ready:
                if time.monotonic() > deadline:
                    raise AssertionError(f"dependencies never healthy:\n{self.diagnosis()}")
                time.sleep(0.5)
                continue
            for name in ready:
                for container in self.containers[name]:
                    self._start(container)
                started.add(name)

    def _deps_met(self, name: str, started: set[str]) -> bool:
        depends = self.config["services"][name].get("depends_on") or {}
        if isinstance(depends, list):
            depends = {dep: {"condition": "service_started"} for dep in depends}
        for dep, rule in depends.items():
            if dep not in started:
                return False
            if rule.get("condition") == "service_healthy" and not self.healthy(dep):
                return False
            if rule.get("condition") == "service_completed_successfully" and not self._completed(
                dep
            ):
                return False
        return True

    def one_shot(self, name: str) -> bool:
        """Others wait for its completion (it has no health check: `provision`)."""
        return any(
            rule.get("condition") == "service_completed_successfully"
            for other in self.names
            for dep, rule in (self._depends(other)).items()
            if dep == name
        )

    def _completed(self, name: str) -> bool:
        """A one-shot service that exited 0."""
        codes = [c.process.poll() if c.process else None for c in self.containers[name]]
        return self.one_shot(name) and all(code == 0 for code in codes)

    def _depends(self, name: str) -> dict[str, Config]:
        depends = self.config["services"][name].get("depends_on") or {}
        if isinstance(depends, list):
            return {dep: {"condition": "service_started"} for dep in depends}
        return dict(depends)

    def _start(self, container: Container) -> None:
        assert container.cwd is not None
        container.cwd.mkdir(parents=True, exist_ok=True)
        for name in container.volume_dirs:
            container.volume_dirs[name].mkdir(parents=True, exist_ok=True)
        container.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(container.log_path, "ab") as log:
            container.process = subprocess.Popen(
                container.argv,
                env=container.env,
                cwd=container.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def down(self, grace_s: float = 20.0) -> None:
        """SIGTERM the services, then NATS (they drain through it); SIGKILL what outlives
        `grace_s`."""
        every = [c for name in self.names for c in self.containers[name]]
        services = [c for c in every if c.service != "nats"]
        for group in (services, [c for c in every if c.service == "nats"]):
            for container in group:
                if container.running:
                    assert container.process is not None
                    container.process.send_signal(signal.SIGTERM)
            self._wait_all(group, grace_s)

    @staticmethod
    def _wait_all(containers: list[Container], grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for container in containers:
            if container.process is None:
                continue
            try:
                container.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                container.process.kill()
                container.process.wait()

    def __enter__(self) -> ComposeProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- health ----------------------------------------------------------------------------

    def healthy(self, service: str) -> bool:
        """The service's compose health check passes on every container."""
        return all(self.check(container) for container in self.containers[service])

    def check(self, container: Container) -> bool:
        """Run the health check's HTTP probes (and their `grep -q WORD`) with ports mapped."""
        test = container.definition.get("healthcheck", {}).get("test", [])
        text = " ".join(test[1:]) if isinstance(test, list) else str(test)
        probe = r"http://127\.0\.0\.1:(\d+)(/[^'\"\s]*)(?:.*?grep -q (\w+))?"
        probes = [found for part in text.split("&&") for found in re.findall(probe, part)]
        if not container.running or not probes:
            return False
        for port, path, word in probes:
            status, body = http_get(container.url(int(port), path))
            if status != 200 or (word and word not in body):
                return False
        return True

    def health(self, container: Container) -> dict[str, Any]:
        """The rlpipe service's /healthz report (HTTP status under `http_status`)."""
        status, body = http_get(container.url(health_port(container.definition), "/healthz"))
        try:
            report: dict[str, Any] = json.loads(body) if body else {}
        except ValueError:
            report = {"body": body[:200]}
        return {"http_status": status, **report}

    def metrics(self, container: Container) -> str:
        status, body = http_get(container.url(health_port(container.definition), "/metrics"))
        return body if status == 200 else ""

    def diagnosis(self, log_lines: int = 6) -> str:
        """Every container: running or its exit code, its /healthz, its log's last lines."""
        lines = []
        for name in self.names:
            for container in self.containers[name]:
                code = container.process.poll() if container.process else "not started"
                state = "running" if code is None else f"exited {code}"
                probed = name != "nats" and not self.one_shot(name)
                report = json.dumps(self.health(container))[:400] if probed else ""
                lines.append(f"- {container.name}: {state} {report}")
                tail = container.log_tail(log_lines)
                lines += [f"    {line[:300]}" for line in tail.splitlines()]
        return "\n".join(lines)


def http_get(url: str, timeout_s: float = 3.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, urllib.error.URLError):
        return 0, ""
