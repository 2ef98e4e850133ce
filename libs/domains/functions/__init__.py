"""The `functions` domain: generated Python functions written to a one-line spec in the
coding environment's sandbox, graded by hidden tests (tasks.py, families.py).

The coding domain's shipped projects are too hard for a policy trained from scratch here;
these tasks need only reading the spec and copying its constants into code, so a warm start
(expert.py) and RL can be measured on held-out tasks of the same families.
"""

from pathlib import Path
from typing import ClassVar

from libs.chat.template import ChatTemplate
from libs.domains.coding.env import CodingConfig, CodingEnv
from libs.domains.coding.rubric import coding_rubric
from libs.domains.domain import Domain
from libs.domains.functions.expert import FunctionsExpert
from libs.domains.functions.tasks import ENV_NAME, GeneratedFunctions
from libs.rollout.agent import AgentSettings


class FunctionsEnv(CodingEnv):
    """The coding environment (sandbox, tools, grading) over the generated tasks."""

    name: ClassVar[str] = ENV_NAME

    def __init__(self, config: CodingConfig | None = None) -> None:
        super().__init__(config, GeneratedFunctions())


def functions_harness(template: ChatTemplate) -> AgentSettings:
    """The default limits with room for a fixed episode in one segment: its six turns take
    ~4.3K bytes, which is what the demonstrations (recorded in bytes) count."""
    return AgentSettings(context_budget_tokens=8192)


DOMAIN = Domain(
    ENV_NAME,
    Path(__file__).resolve().parent,
    FunctionsEnv,
    coding_rubric,
    harness=functions_harness,
    expert=FunctionsExpert,
)
