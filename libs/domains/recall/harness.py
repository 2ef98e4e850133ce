"""The harness limits `recall` is made for: a context segment too small for the whole code.

A segment holds the opening with a summary, REVEALS_PER_SEGMENT reveals (a call and its
result) and room for one more turn, measured in the policy's own chat template (955 tokens
with the byte tokenizer, 216 with the BPE tokenizer of recall's warm start). Summaries are
short: they need only the digits read so far and how many there are.
"""

from __future__ import annotations

from libs.chat.template import ChatTemplate, render_tool_results
from libs.chat.tool_calls import format_tool_call
from libs.domains.recall.env import SYSTEM_PROMPT, TOOL_NAME, TOOLS, TURN_MAX_TOKENS, RecallTasks
from libs.rollout.agent import SUMMARY_RESUME, AgentSettings
from proto.messages import ChatMessage, ToolResult

MAX_TURNS = 24
REVEALS_PER_SEGMENT = 3
SUMMARY_MAX_TOKENS = 48
MAX_SUMMARIES = 6


def recall_harness(template: ChatTemplate) -> AgentSettings:
    """Recall's harness limits, with token counts in `template`'s tokens (the policy's)."""
    return AgentSettings(
        max_turns=MAX_TURNS,
        context_budget_tokens=recall_context_budget(template),
        summary_max_tokens=SUMMARY_MAX_TOKENS,
        max_summaries=MAX_SUMMARIES,
    )


def recall_context_budget(template: ChatTemplate) -> int:
    """Tokens of a recall context segment: the opening with a summary, REVEALS_PER_SEGMENT
    reveals and room for one more turn, rendered in `template`."""
    task = RecallTasks(difficulty=0, group_size=1, seed=0).task(0)
    summary = SUMMARY_RESUME.format(summary="Digits read: 739 (3 of 6).")
    messages = [
        ChatMessage(role="system", content=SYSTEM_PROMPT),
        ChatMessage(role="user", content=task.prompt),
        ChatMessage(role="user", content=summary),
    ]
    opening = template.render(messages, tools=TOOLS, add_generation_prompt=False)
    call = [*template.tokenizer.encode(format_tool_call(TOOL_NAME, {})), template.stop_token_ids[0]]
    call = [*template.generation_prompt(), *call, *template.end_of_assistant(call)]
    result = ToolResult(call_id="call-3-0", name=TOOL_NAME, content="digit 3 of 6: 7")
    reveal = len(call) + len(template.render_message(render_tool_results([result])))
    turn = len(template.generation_prompt()) + TURN_MAX_TOKENS
    return len(opening) + REVEALS_PER_SEGMENT * reveal + turn
