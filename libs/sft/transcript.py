"""Chat transcripts for supervised fine-tuning: the JSONL format, its reader, its rendering.

One line is one conversation as the policy sees it in one context segment (a
self-summarizing episode is several lines: the segment that ends with the summary, then the
segments that start from it). Fields:

    {"tools": [{"name": "add", "description": "...", "parameters": {...}}],
     "messages": [
       {"role": "system", "content": "..."},
       {"role": "user", "content": "What is 12 + 7?"},
       {"role": "assistant", "content": "",
        "tool_calls": [{"id": "call-0-0", "name": "add", "arguments": {"a": 12, "b": 7}}]},
       {"role": "tool", "tool_call_id": "call-0-0", "name": "add", "content": "19"},
       {"role": "assistant", "content": "19"}]}

Rendering is the harness's (libs.rollout.agent): the tools are described in the system
message, an assistant turn's text is its content followed by its calls in the tool-call
format (libs.chat.tool_calls), consecutive tool messages become one `<tool_result>` message,
and the chat template (libs.chat.template) turns it all into ids. The loss mask covers what
the policy generates in an episode: each assistant turn's tokens and its stop token, not the
generation prompt nor anything else.

    examples = read_transcripts(Path("demos.jsonl"))      # TranscriptError names line + field
    ids, mask = render_transcript(examples[0], chat_template_for(tokenizer))
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.chat.template import ChatTemplate, render_tool_results, with_tools
from libs.chat.tool_calls import format_tool_call
from libs.malformed_input import MALFORMED_INPUT_ERRORS, describe_malformed
from proto.messages import ChatMessage, ToolResult, ToolSpec

ROLES = ("system", "user", "assistant", "tool")


class TranscriptError(ValueError):
    """A malformed transcript line: which file, line (1-based) and field, and what is wrong."""

    def __init__(self, path: str, line: int, field_path: str, problem: str) -> None:
        super().__init__(f"{path} line {line}: {field_path}: {problem}")
        self.path, self.line, self.field_path, self.problem = path, line, field_path, problem


@dataclass(frozen=True)
class SftCall:
    """A tool call an assistant message makes."""

    name: str
    arguments: dict[str, Any]
    call_id: str = ""


@dataclass(frozen=True)
class SftMessage:
    """One message: `tool_calls` on assistant messages, `call_id`/`name`/`error` on tool ones."""

    role: str
    content: str
    tool_calls: tuple[SftCall, ...] = ()
    call_id: str = ""
    name: str = ""
    error: str = ""


@dataclass(frozen=True)
class Transcript:
    """One training conversation and the tools it offered."""

    messages: tuple[SftMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


def assistant_text(content: str, calls: Sequence[SftCall]) -> str:
    """The text an assistant turn with `content` and `calls` is generated as (and parsed from)."""
    parts = [content] if content else []
    parts += [format_tool_call(call.name, call.arguments) for call in calls]
    return "\n".join(parts)


def render_transcript(
    transcript: Transcript, template: ChatTemplate
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of `transcript` as the harness lays out an episode's segment."""
    ids: list[int] = []
    mask: list[int] = []
    for message in with_tools(chat_messages(transcript.messages), transcript.tools):
        if message.role == "assistant":
            prompt = template.generation_prompt()
            body = [*template.tokenizer.encode(message.content), template.stop_token_ids[0]]
            tail = template.end_of_assistant(body)
            ids += [*prompt, *body, *tail]
            mask += [0] * len(prompt) + [1] * len(body) + [0] * len(tail)
        else:
            rendered = template.render_message(message)
            ids += rendered
            mask += [0] * len(rendered)
    return ids, mask


def transcript_texts(transcript: Transcript) -> list[str]:
    """The text of each message of `transcript` as the template lays it out (role, then
    content: tool list, calls and results included), for training a tokenizer on."""
    messages = with_tools(chat_messages(transcript.messages), transcript.tools)
    return [f"{message.role}\n{message.content}\n" for message in messages]


def without_system_message(transcript: Transcript) -> Transcript:
    """`transcript` with no system message and no tools (the tools are listed in it)."""
    messages = tuple(m for m in transcript.messages if m.role != "system")
    return Transcript(messages=messages, tools=(), meta=transcript.meta)


def chat_messages(messages: Sequence[SftMessage]) -> list[ChatMessage]:
    """The chat messages the template renders: calls written into the assistant text, each
    run of tool messages merged into one tool message of `<tool_result>` blocks."""
    out: list[ChatMessage] = []
    results: list[ToolResult] = []
    for message in messages:
        if message.role == "tool":
            results.append(
                ToolResult(
                    call_id=message.call_id,
                    name=message.name,
                    content=message.content,
                    error=message.error,
                )
            )
            continue
        if results:
            out.append(render_tool_results(results))
            results = []
        content = message.content
        if message.role == "assistant":
            content = assistant_text(message.content, message.tool_calls)
        out.append(ChatMessage(role=message.role, content=content))  # type: ignore[arg-type]
    if results:
        out.append(render_tool_results(results))
    return out


def read_transcripts(path: Path) -> list[Transcript]:
    """Every transcript of a JSONL file (blank lines skipped); TranscriptError on a bad line."""
    return list(iter_transcripts(path))


def iter_transcripts(path: Path) -> Iterator[Transcript]:
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                yield parse_line(line, str(path), number)


def parse_line(line: str, path: str, number: int) -> Transcript:
    """One JSONL line as a Transcript; TranscriptError names the line and field."""
    try:
        value = json.loads(line)
    except MALFORMED_INPUT_ERRORS as exc:
        message = f"not valid JSON: {describe_malformed(exc)}"
        raise TranscriptError(path, number, "(line)", message) from None
    return _Reader(path, number).transcript(value)


class _Reader:
    """Checks one decoded line, raising TranscriptError with the field's path."""

    def __init__(self, path: str, line: int) -> None:
        self.path, self.line = path, line

    def fail(self, field_path: str, problem: str) -> TranscriptError:
        return TranscriptError(self.path, self.line, field_path, problem)

    def transcript(self, value: Any) -> Transcript:
        if not isinstance(value, dict):
            raise self.fail("(line)", 'must be a JSON object {"messages": [...]}')
        messages = value.get("messages")
        if not isinstance(messages, list) or not messages:
            raise self.fail("messages", "must be a non-empty list of messages")
        parsed = tuple(self.message(m, f"messages[{i}]") for i, m in enumerate(messages))
        if not any(m.role == "assistant" for m in parsed):
            raise self.fail("messages", "has no assistant message: nothing to train on")
        tools = value.get("tools", [])
        if not isinstance(tools, list):
            raise self.fail("tools", "must be a list of tool specs")
        meta = value.get("meta", {})
        if not isinstance(meta, dict):
            raise self.fail("meta", "must be an object")
        specs = tuple(self.tool(t, f"tools[{i}]") for i, t in enumerate(tools))
        return Transcript(messages=parsed, tools=specs, meta=meta)

    def message(self, value: Any, where: str) -> SftMessage:
        if not isinstance(value, dict):
            raise self.fail(where, "must be an object with role and content")
        role = value.get("role")
        if role not in ROLES:
            raise self.fail(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        content = self.string(value, "content", where, required=True)
        if role == "tool":
            return SftMessage(
                role=role,
                content=content,
                call_id=self.string(value, "tool_call_id", where, required=True),
                name=self.string(value, "name", where, required=True),
                error=self.string(value, "error", where),
            )
        calls = value.get("tool_calls", [])
        if calls and role != "assistant":
            raise self.fail(f"{where}.tool_calls", "only assistant messages make tool calls")
        if not isinstance(calls, list):
            raise self.fail(f"{where}.tool_calls", "must be a list of calls")
        parsed = tuple(self.call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls))
        return SftMessage(role=role, content=content, tool_calls=parsed)

    def call(self, value: Any, where: str) -> SftCall:
        if not isinstance(value, dict):
            raise self.fail(where, 'must be an object {"name": ..., "arguments": {...}}')
        name = self.string(value, "name", where, required=True)
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            raise self.fail(f"{where}.arguments", "must be a JSON object")
        return SftCall(name=name, arguments=arguments, call_id=self.string(value, "id", where))

    def tool(self, value: Any, where: str) -> ToolSpec:
        if not isinstance(value, dict):
            raise self.fail(where, "must be an object with name, description, parameters")
        parameters = value.get("parameters", {})
        if not isinstance(parameters, dict):
            raise self.fail(f"{where}.parameters", "must be a JSON Schema object")
        return ToolSpec(
            name=self.string(value, "name", where, required=True),
            description=self.string(value, "description", where),
            parameters=parameters,
        )

    def string(self, value: dict[str, Any], key: str, where: str, required: bool = False) -> str:
        if key not in value:
            if required:
                raise self.fail(f"{where}.{key}", "is missing")
            return ""
        if not isinstance(value[key], str):
            raise self.fail(f"{where}.{key}", f"must be a string, got {type(value[key]).__name__}")
        return str(value[key])


def transcript_to_json(transcript: Transcript) -> dict[str, Any]:
    """The JSONL object of `transcript` (what `parse_line` reads back)."""
    return {
        "tools": [
            {"name": t.name, "description": t.description, "parameters": t.parameters}
            for t in transcript.tools
        ],
        "messages": [_message_json(m) for m in transcript.messages],
        **({"meta": transcript.meta} if transcript.meta else {}),
    }


def _message_json(message: SftMessage) -> dict[str, Any]:
    value: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "tool":
        value |= {"tool_call_id": message.call_id, "name": message.name}
        if message.error:
            value["error"] = message.error
    if message.tool_calls:
        value["tool_calls"] = [
            {"id": c.call_id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls
        ]
    return value
