"""The `recall` domain: read a code one digit per tool call, across summarized segments."""

from pathlib import Path

from libs.domains.domain import Domain
from libs.domains.recall.env import ENV_NAME, RecallEnv
from libs.domains.recall.expert import RecallExpert
from libs.domains.recall.harness import recall_harness
from libs.domains.recall.rubric import recall_rubric

DOMAIN = Domain(
    name=ENV_NAME,
    folder=Path(__file__).resolve().parent,
    env=RecallEnv,
    rubric=recall_rubric,
    expert=RecallExpert,
    harness=recall_harness,
    description="a code read one digit per call; episodes outgrow one context segment",
)
