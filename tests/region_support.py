"""Hub and region nats-servers running the shipped configs on loopback (deploy/nats/hub.conf
and region-leaf.conf with their includes, copied with a test's ports and folders), for
tests/test_region_link.py, tests/test_region_training.py and tests/test_region_outage.py.

    with linked_servers(hub_dir, region_dir) as (hub, region):   # provisioned, linked
        bus = await connect_bus(hub.url, "reward", options=hub_user("reward"))

    link = LinkCutter()                  # the leaf link through a TCP relay this test can cut
    with linked_servers(hub_dir, region_dir, link=link) as (hub, region):
        link.cut()                       # both servers stay up; the region's leaf cannot reach
        link.restore()                   # the hub until restored, then reconnects on its own
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.bus.connection import NatsOptions, connect_bus
from libs.bus.provision import provision
from libs.nats_server import NatsServer, free_port
from proto import permissions
from proto.permissions import REGION_ROLES, ROLES, password_variable

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "nats"
HUB_PASSWORDS = {name: f"hub{name.replace('-', '')}Pw0" for name in ROLES}
REGION_PASSWORDS = {name: f"region{name.replace('-', '')}Pw0" for name in REGION_ROLES}
REGION = permissions.REGIONS[0]


@dataclass
class ShippedConfigServer(NatsServer):
    """A nats-server running a shipped config file (with its includes) copied beside its
    store, this test's ports and folder written over the container's."""

    shipped: str = "nats.conf"

    def write_config(self) -> Path:
        folder = self.store_dir / "config"
        shutil.copytree(DEPLOY, folder, dirs_exist_ok=True)
        for path in folder.glob("*.conf"):
            text = path.read_text()
            text = re.sub(r"^(\s*)store_dir:.*$", rf'\1store_dir: "{self.store_dir}/js"', text,
                          flags=re.M)  # fmt: skip
            text = re.sub(r"^port: 4222$", f"port: {self.port}", text, flags=re.M)
            text = re.sub(r"^http_port: 8222$", f"http_port: {self.monitor_port}", text, flags=re.M)
            text = re.sub(r"^(\s+)port: 7422$", rf"\1port: {self.leafnode_port}", text, flags=re.M)
            path.write_text(text)
        top = folder / self.shipped
        top.write_text(top.read_text() + '\nhost: "127.0.0.1"\n')
        return top


def hub_environment() -> dict[str, str]:
    return {ROLES[name].password_variable: pw for name, pw in HUB_PASSWORDS.items()}


class LinkCutter:
    """A TCP relay on loopback between the region's leaf connection and the hub's leafnode
    port: `cut` closes every connection through it and refuses new ones until `restore`
    (a network partition: both servers keep running). Threads, so a busy test loop cannot
    slow the link."""

    def __init__(self) -> None:
        self.port = free_port()
        self._target = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))

    def start(self, target_port: int) -> None:
        self._target = target_port
        threading.Thread(target=self._accept, daemon=True, name="link-cutter").start()

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._open.is_set():
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target), timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    _close(source)
    _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextmanager
def linked_servers(
    hub_dir: Path, region_dir: Path, *, link: LinkCutter | None = None
) -> Iterator[tuple[NatsServer, NatsServer]]:
    """The hub (hub.conf: every user, the leafnode listener, domain hub; provisioned) and the
    region (region-leaf.conf: its own users, domain region-a, linking as leaf-region-a;
    through `link` when given)."""
    leaf_port = free_port()
    hub = ShippedConfigServer(store_dir=hub_dir, shipped="hub.conf", leafnode_port=leaf_port)
    region = ShippedConfigServer(store_dir=region_dir, shipped="region-leaf.conf")
    leaf = f"leaf-{REGION}"
    if link is not None:
        link.start(leaf_port)
    port = leaf_port if link is None else link.port
    leaf_url = f"nats-leaf://{leaf}:{HUB_PASSWORDS[leaf]}@127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:  # the configs read passwords from the environment
        for variable, value in hub_environment().items():
            env.setenv(variable, value)
        for name, value in REGION_PASSWORDS.items():
            env.setenv(password_variable(name, "region"), value)
        env.setenv("RLPIPE_NATS_LEAF_URL", leaf_url)
        hub.start()
        asyncio.run(provision_hub(hub))
        region.start()
    try:
        yield hub, region
    finally:
        region.stop()
        hub.stop()
        if link is not None:
            link.close()


async def provision_hub(hub: NatsServer) -> None:
    bus = await connect_bus(hub.url, "admin", options=hub_user("admin"))
    try:
        await provision(bus.js)
    finally:
        await bus.close()


def hub_user(name: str) -> NatsOptions:
    return NatsOptions(user=name, password=HUB_PASSWORDS[name])


def region_user(name: str) -> NatsOptions:
    return NatsOptions(user=name, password=REGION_PASSWORDS[name])
