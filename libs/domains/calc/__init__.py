"""The `calc` domain: multi-step integer arithmetic with calculator tools."""

from pathlib import Path

from libs.domains.calc.env import ENV_NAME, CalcEnv
from libs.domains.calc.expert import CalcExpert
from libs.domains.calc.rubric import calc_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(
    name=ENV_NAME,
    folder=Path(__file__).resolve().parent,
    env=CalcEnv,
    rubric=calc_rubric,
    expert=CalcExpert,
    description="an expression worked out with add/subtract/multiply/divide tool calls",
)
