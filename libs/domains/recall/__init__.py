"""The `recall` domain: read a code one digit per tool call, across summarized segments."""

from pathlib import Path

from libs.domains.domain import Domain
from libs.domains.recall.env import ENV_NAME, RecallEnv
from libs.domains.recall.expert import RecallExpert
from libs.domains.recall.harness import recall_harness
from libs.domains.recall.rubric import recall_rubric

DOMAIN = Domain(
    ENV_NAME,
    Path(__file__).resolve().parent,
    RecallEnv,
    recall_rubric,
    harness=recall_harness,
    expert=RecallExpert,
)
