"""The `arith` domain: copy a digit or add two numbers, single turn (the demo's default)."""

from pathlib import Path

from libs.domains.arith.env import ENV_NAME, ArithmeticEnv
from libs.domains.arith.rubric import arith_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(ENV_NAME, Path(__file__).resolve().parent, ArithmeticEnv, arith_rubric)
