"""echo's harness limits: one turn, a small context (the workers and the eval gate use these)."""

from libs.chat.template import ChatTemplate
from libs.rollout.agent import AgentSettings


def echo_harness(template: ChatTemplate) -> AgentSettings:
    return AgentSettings(max_turns=1, context_budget_tokens=512)
