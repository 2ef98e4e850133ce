"""The `calc` domain: multi-step integer arithmetic with calculator tools."""

from pathlib import Path

from libs.domains.calc.env import ENV_NAME, CalcEnv
from libs.domains.calc.expert import CalcExpert
from libs.domains.calc.rubric import calc_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(ENV_NAME, Path(__file__).resolve().parent, CalcEnv, calc_rubric, expert=CalcExpert)
