"""The run's own key pair for signed weight versions (libs/weights/signing.py).

`rlpipe demo` / `rlpipe run` make one pair per run folder (`<run>/weights-signing/`, the
private key mode 0600) on first use and keep it when the run is resumed. The trainer and the
weight-broadcaster get the private key, every rollout-worker (serve replicas too) the public
one: a version published on the run's bus by anyone else is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from libs.weights.signing import ensure_key_pair

KEY_DIR = "weights-signing"
VARIABLES = (
    "RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY",
    "RLPIPE_TRAINER_SAME_HOST_SIGNING_KEY",
    "RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS",
)


def signing_environment(service: str, run_dir: Path) -> dict[str, str]:
    """The variables that point `service` at the run's key pair (made if absent)."""
    keys = ensure_key_pair(run_dir / KEY_DIR)
    if service == "weight-broadcaster":
        return {"RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY": str(keys.private_path)}
    if service == "trainer":  # it signs the versions it shares on its host
        return {"RLPIPE_TRAINER_SAME_HOST_SIGNING_KEY": str(keys.private_path)}
    if service == "rollout-worker":
        return {"RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS": str(keys.public_path)}
    return {}


@contextlib.contextmanager
def run_keys_assumed() -> Iterator[None]:
    """While the launcher loads the services' settings in its own process (`rlpipe demo`'s
    check, the harness limits): the key variables `signing_environment` will give the
    services (the pair is made with the run folder), where the environment has none."""
    unset = [name for name in VARIABLES if name not in os.environ]
    for name in unset:
        os.environ[name] = f"<run folder>/{KEY_DIR}"
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


def run_signing_environment(run_dir: Path) -> dict[str, str]:
    """Every service's key variables for a run on this machine (`rlpipe ray up` without
    --address), the pair made in the run folder; none where this environment names a key."""
    if any(name in os.environ for name in VARIABLES):
        return {}
    env: dict[str, str] = {}
    for service in ("weight-broadcaster", "trainer", "rollout-worker"):
        env |= signing_environment(service, run_dir)
    return env
