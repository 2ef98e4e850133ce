"""The services of rlpipe: the one list that `rlpipe run`, the demo launcher and the Ray
deployment draw from.

It lives in proto, beside the subjects the services speak, because it is part of the
contract: the NATS users and the per-service identities are made from these names, and any
process may import proto (it depends on nothing heavy).

    for name in SERVICES:
        importlib.import_module(f"{service_module(name)}.settings")
"""

SERVICES = (
    "trainer",
    "rollout-worker",
    "env-gateway",
    "reward",
    "weight-broadcaster",
    "feedback-ingester",
)


# Services a deployment adds when it needs them, never started by `rlpipe demo`, compose or
# Ray: the capacity controller lends serve replicas to RL (docs/fleet.md).
OPTIONAL_SERVICES = ("capacity-controller",)


def service_module(name: str) -> str:
    """The package a service runs from: "rollout-worker" -> "services.rollout_worker"."""
    return f"services.{name.replace('-', '_')}"
