"""The demo's secured bus: a user per role with a password made for this run, optionally TLS
with client certificates from a CA made for this run.

    bus = SecureBus.generate(run_dir, tls=False)
    NatsServer(..., extra_config=bus.server_config())   # users from proto/permissions.py
    bus.admin_options()             # the launcher's own connections: provisioning, reports
    bus.service_environment("reward")   # RLPIPE_NATS_USER/PASSWORD of its role, no provision

Why the default and not a flag: it costs the demo nothing it would notice (passwords are
made in microseconds, the CA in milliseconds, and the server checks permissions per
subscription and cached per subject), and a demo on the open bus would be the one place
the permissions of proto/permissions.py are never exercised. `--open-bus` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from libs.bus.auth_config import new_password, render_authorization
from libs.bus.tls_files import LocalPki, make_local_pki
from proto.permissions import ROLES, SERVICE_ROLES, inbox_prefix

if TYPE_CHECKING:
    from libs.bus.connection import NatsOptions


@dataclass(frozen=True)
class SecureBus:
    """This run's users (role -> password) and, with TLS, its CA and certificates."""

    passwords: dict[str, str] = field(default_factory=dict)
    pki: LocalPki | None = None

    @classmethod
    def generate(cls, run_dir: Path, *, tls: bool = False) -> SecureBus:
        passwords = {name: new_password() for name in ROLES}
        pki = make_local_pki(run_dir / "tls") if tls else None
        return cls(passwords, pki)

    def server_config(self) -> str:
        """The server's users (and `tls {}` block, verifying clients), for NatsServer."""
        text = render_authorization(ROLES.values(), self.passwords)
        return text + (self.pki.server_tls_block(verify=True) if self.pki else "")

    def options(self, role: str) -> NatsOptions:
        """How a process of `role` connects: its user, its inbox, the run's certificates."""
        from libs.bus.connection import NatsOptions  # imports nats-py: only when connecting

        pki = self.pki
        return NatsOptions(
            user=role,
            password=self.passwords[role],
            inbox_prefix=inbox_prefix(role),
            tls_ca_file=pki.ca_file if pki else None,
            tls_cert_file=pki.client_cert_file if pki else None,
            tls_key_file=pki.client_key_file if pki else None,
        )

    def admin_options(self) -> NatsOptions:
        return self.options("admin")

    def service_environment(self, service: str, nats_url: str) -> dict[str, str]:
        """Variables that make `service` connect as its role; the launcher provisions as the
        admin, so the service does not (its user may not)."""
        role = SERVICE_ROLES[service]
        env = {
            "RLPIPE_NATS_USER": role,
            "RLPIPE_NATS_PASSWORD": self.passwords[role],
            "RLPIPE_PROVISION": "false",
            **(self.pki.client_environment() if self.pki else {}),
        }
        if service == "feedback-ingester":
            # The API publishes as the feedback-api user through its own connection.
            env["RLPIPE_FEEDBACK_INGESTER_API_NATS_URL"] = with_user(
                nats_url, "feedback-api", self.passwords["feedback-api"]
            )
        return env


def with_user(url: str, user: str, password: str) -> str:
    """`nats://h:1,nats://h:2` with `user:password@` in every URL."""
    return ",".join(
        part.strip().replace("://", f"://{user}:{password}@", 1) for part in url.split(",")
    )
