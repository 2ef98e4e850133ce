"""A certificate authority made for one run: a CA, the NATS server's certificate and a
client certificate, all signed by it (the demo's `--tls`, the TLS tests).

    pki = make_local_pki(run_dir / "tls", hosts=("127.0.0.1", "localhost"))
    pki.server_tls_block(verify=True)   # the nats-server `tls {}` block (mTLS with verify)
    pki.client_options()                # NatsOptions fields: CA, client cert and key

Keys are EC P-256, certificates valid for a week: enough for a run, useless after. A real
deployment brings its own CA (cert-manager, a company PKI); deploy/nats/SECURITY.md says how.
Made with the `cryptography` package (already installed with the model stack).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VALID_DAYS = 7


@dataclass(frozen=True)
class LocalPki:
    """Paths of a run's CA and the certificates it signed."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path

    def server_tls_block(self, *, verify: bool = True) -> str:
        """The server's `tls {}` block; with `verify` every client must show a certificate
        this CA signed (mTLS), else it is refused at the handshake."""
        lines = [
            f"  cert_file: {json.dumps(str(self.server_cert_file))}",
            f"  key_file: {json.dumps(str(self.server_key_file))}",
            f"  ca_file: {json.dumps(str(self.ca_file))}",
            f"  verify: {'true' if verify else 'false'}",
            "  timeout: 5",
        ]
        return "tls {\n" + "\n".join(lines) + "\n}\n"

    def client_environment(self) -> dict[str, str]:
        """The variables a service reads its TLS options from (libs.settings)."""
        return {
            "RLPIPE_NATS_TLS_CA_FILE": str(self.ca_file),
            "RLPIPE_NATS_TLS_CERT_FILE": str(self.client_cert_file),
            "RLPIPE_NATS_TLS_KEY_FILE": str(self.client_key_file),
        }


def make_local_pki(
    directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
) -> LocalPki:
    """Write a fresh CA, a server certificate for `hosts` and a client certificate."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as exc:  # pragma: no cover - installed with the model stack
        raise RuntimeError(
            "making a local CA needs the `cryptography` package: pip install cryptography"
        ) from exc
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("rlpipe run CA", ca_key, ca_key, None, is_ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _certificate("rlpipe nats", server_key, ca_key, ca_cert, hosts=hosts)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _certificate("rlpipe client", client_key, ca_key, ca_cert, client=True)
    pki = LocalPki(
        ca_file=directory / "ca.pem",
        server_cert_file=directory / "server.pem",
        server_key_file=directory / "server-key.pem",
        client_cert_file=directory / "client.pem",
        client_key_file=directory / "client-key.pem",
    )
    _write(pki.ca_file, _pem(ca_cert))
    _write(pki.server_cert_file, _pem(server_cert))
    _write(pki.server_key_file, _key_pem(server_key))
    _write(pki.client_cert_file, _pem(client_cert))
    _write(pki.client_key_file, _key_pem(client_key))
    return pki


def _certificate(
    name: str,
    key: Any,
    signer_key: Any,
    signer: Any,
    *,
    is_ca: bool = False,
    hosts: tuple[str, ...] = (),
    client: bool = False,
) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer.subject if signer is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if hosts:
        names = [_general_name(host) for host in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if not is_ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(signer_key, hashes.SHA256())


def _general_name(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _write(path: Path, data: bytes) -> None:
    """Owner-only: keys are secrets, and the whole folder is the run's."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
