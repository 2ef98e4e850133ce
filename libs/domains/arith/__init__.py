"""The `arith` domain: copy a digit or add two numbers, single turn (the demo's default)."""

from pathlib import Path

from libs.domains.arith.env import ENV_NAME, ArithmeticEnv
from libs.domains.arith.rubric import arith_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(
    name=ENV_NAME,
    folder=Path(__file__).resolve().parent,
    env=ArithmeticEnv,
    rubric=arith_rubric,
    description="copy a digit or add two d-digit numbers; single turn, plain text",
)
