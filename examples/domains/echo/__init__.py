"""echo: a domain of your own, in one folder (docs/domains.md).

The policy is asked to say a word and is rewarded when it does. Single turn, plain text:

    RLPIPE_DOMAIN_PATHS=examples/domains/echo rlpipe domain list

Every service started with that variable (env-gateway, reward, the trainer's eval gate) finds
the domain here; nothing outside this folder names it.
"""

from pathlib import Path

from libs.domains.domain import Domain

from .env import EchoEnv
from .harness import echo_harness
from .rubric import echo_rubric

DOMAIN = Domain(
    name="echo",
    folder=Path(__file__).resolve().parent,
    env=EchoEnv,
    rubric=echo_rubric,
    harness=echo_harness,
)
