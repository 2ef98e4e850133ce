"""TLS with client certificates (mTLS) on a real nats-server, from a CA made for the test
(libs/bus/tls_files.py, what `rlpipe demo --tls` makes for a run): a client with a
certificate that CA signed connects and uses JetStream; one without a certificate, or
without TLS, is refused.

Run: .venv/bin/python -m pytest tests/test_nats_tls.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.bus.auth_config import render_authorization
from libs.bus.connection import BusConnectError, NatsOptions, connect_bus
from libs.bus.provision import provision
from libs.bus.tls_files import LocalPki, make_local_pki
from libs.nats_server import NatsServer
from proto import streams, subjects
from proto.permissions import ROLES

PASSWORDS = {name: f"tls-{name}-password" for name in ROLES}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    return make_local_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pki: LocalPki) -> Iterator[NatsServer]:
    config = render_authorization(ROLES.values(), PASSWORDS) + pki.server_tls_block(verify=True)
    server = NatsServer(store_dir=tmp_path_factory.mktemp("nats-tls"), extra_config=config)
    server.start()
    yield server
    server.stop()


def options(role: str, pki: LocalPki, *, certificate: bool = True) -> NatsOptions:
    return NatsOptions(
        user=role,
        password=PASSWORDS[role],
        tls_ca_file=pki.ca_file,
        tls_cert_file=pki.client_cert_file if certificate else None,
        tls_key_file=pki.client_key_file if certificate else None,
    )


async def test_a_client_with_a_certificate_connects_and_uses_jetstream(
    server: NatsServer, pki: LocalPki
) -> None:
    admin = await connect_bus(server.url, "admin", options=options("admin", pki))
    reward = await connect_bus(server.url, "reward", options=options("reward", pki))
    try:
        await provision(admin.js)
        ack = await reward.js.publish(subjects.ROLLOUTS_SCORED, b"scored")
        assert ack.stream == streams.ROLLOUTS_SCORED.name
        assert reward.nc.connected_url is not None
    finally:
        await reward.close()
        await admin.close()


async def test_a_client_without_a_certificate_is_refused(server: NatsServer, pki: LocalPki) -> None:
    with pytest.raises(BusConnectError):
        await connect_bus(
            server.url,
            "no-cert",
            options=options("reward", pki, certificate=False),
            max_attempts=1,
        )


async def test_a_client_without_tls_is_refused(server: NatsServer) -> None:
    plain = NatsOptions(user="reward", password=PASSWORDS["reward"])
    with pytest.raises(BusConnectError):
        await connect_bus(server.url, "plain", options=plain, max_attempts=1)


def test_the_ca_signs_for_loopback_and_keys_stay_private(pki: LocalPki) -> None:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pki.server_cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
    for key in (pki.server_key_file, pki.client_key_file):
        assert Path(key).stat().st_mode & 0o077 == 0, f"{key} is readable by others"
