"""The weight-signing key pair of a test session (libs/weights/signing.py).

conftest.py points the services' settings at it (RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY,
RLPIPE_TRAINER_SAME_HOST_SIGNING_KEY, RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS), so every
service a test starts, in its process or as a subprocess, signs and verifies as a deployment
does; tests that build a broadcaster or a receiver themselves use SIGNER and `trusting`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from libs.weights.receiver import ReceiverConfig
from libs.weights.signing import VersionSigner, ensure_key_pair, generate_key_pair

# One pair per test session: pytest-xdist's workers inherit the folder from the controller.
_DIR_VARIABLE = "RLPIPE_TEST_SIGNING_DIR"
if os.environ.get(_DIR_VARIABLE) and Path(os.environ[_DIR_VARIABLE]).is_dir():
    KEYS = ensure_key_pair(os.environ[_DIR_VARIABLE])
else:
    _key_dir = Path(tempfile.mkdtemp(prefix="rlpipe-test-signing-"))
    atexit.register(shutil.rmtree, _key_dir, ignore_errors=True)
    os.environ[_DIR_VARIABLE] = str(_key_dir)
    KEYS = generate_key_pair(_key_dir)
SIGNER = VersionSigner.load(KEYS.private_path)


def trusting(**fields: Any) -> ReceiverConfig:
    """A receiver's config that trusts the session's key."""
    return ReceiverConfig(signers=[KEYS.public_text], **fields)


def signing_environment() -> dict[str, str]:
    """The variables that make services sign and verify with the session's key."""
    return {
        "RLPIPE_WEIGHT_BROADCASTER_SIGNING_KEY": str(KEYS.private_path),
        "RLPIPE_TRAINER_SAME_HOST_SIGNING_KEY": str(KEYS.private_path),
        "RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS": str(KEYS.public_path),
    }
