"""Chat templates: conversations as token ids, built incrementally so nothing is re-tokenized.

The harness never re-encodes text the policy generated: an episode's token sequence is the
opening (`render(..., add_generation_prompt=True)`), then each assistant turn's ids exactly as
the engine sampled them, then `render_continuation(...)` for the messages that follow (tool
results, a user message) and the next generation prompt. Serve mode renders whole
conversations with `render`.

Three templates:
- `PlainTextTemplate` (single-turn text environments such as `arith`, whose opening is a bare
  `observation`): the text's ids alone, no role markers; the tokenizer's eos ends a turn.
- `ByteChatTemplate` (the embedded byte tokenizer): `<|system|>`, `<|user|>`, `<|assistant|>`
  special ids, the content's UTF-8 bytes, then `<|eos|>` to end the message.
- `ChatMLTemplate` (local HF tokenizers with `<|im_start|>`/`<|im_end|>`, e.g. Qwen):
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`.

Tool results are rendered as a user message whose content holds `<tool_result>` blocks
(`render_tool_results`), the way Qwen-style templates do: no extra role token is needed.
The tools offered are listed in the system message (`libs.chat.tool_calls.describe_tools`).

`save_tokenizer(tokenizer, folder)` writes a tokenizer's files into a model folder with its
template as a transformers chat template, so the folder loads with both anywhere.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from pathlib import Path

from libs.chat.tool_calls import describe_tools
from libs.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, byte_tokenizer_as_hf
from proto.messages import ChatMessage, ToolResult, ToolSpec


class ChatTemplate(abc.ABC):
    """Renders messages to token ids for one tokenizer."""

    supports_summaries: bool = True
    """Whether the policy can be asked to summarize in this format (a chat has turns to ask
    in; a bare text prompt does not)."""
    jinja: str = ""
    """The same rendering as a transformers chat template (saved with checkpoints), "" when
    the format has none."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    @abc.abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn (kept as its last token)."""

    @abc.abstractmethod
    def render_message(self, message: ChatMessage) -> list[int]:
        """Ids of one complete message, end marker included."""

    @abc.abstractmethod
    def generation_prompt(self) -> list[int]:
        """Ids that open the assistant's turn."""

    def end_of_assistant(self, generated_ids: Sequence[int]) -> list[int]:
        """Ids that close an assistant turn the engine cut short (no stop id at its end)."""
        if generated_ids and generated_ids[-1] in self.stop_token_ids:
            return []
        return [self.stop_token_ids[0]]

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Ids of a whole conversation; the tools are described in the system message."""
        ids: list[int] = []
        for message in with_tools(messages, tools):
            ids.extend(self.render_message(message))
        if add_generation_prompt:
            ids.extend(self.generation_prompt())
        return ids

    def render_continuation_body(
        self, generated_ids: Sequence[int], messages: Sequence[ChatMessage]
    ) -> list[int]:
        """Ids that follow an assistant turn of `generated_ids`: its end marker if the engine
        did not produce one, then `messages` (no generation prompt)."""
        ids = self.end_of_assistant(generated_ids)
        for message in messages:
            ids.extend(self.render_message(message))
        return ids

    def render_continuation(
        self, generated_ids: Sequence[int], messages: Sequence[ChatMessage]
    ) -> list[int]:
        """`render_continuation_body`, then the next generation prompt."""
        return [*self.render_continuation_body(generated_ids, messages), *self.generation_prompt()]


class PlainTextTemplate(ChatTemplate):
    """Bare text: a message is its content's ids; nothing opens or closes a turn."""

    supports_summaries = False

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_id,)

    def render_message(self, message: ChatMessage) -> list[int]:
        return self.tokenizer.encode(message.content)

    def generation_prompt(self) -> list[int]:
        return []

    def end_of_assistant(self, generated_ids: Sequence[int]) -> list[int]:
        return []


class ByteChatTemplate(ChatTemplate):
    """Role special ids + UTF-8 bytes + `<|eos|>`, for the byte tokenizer."""

    jinja = (
        "{% for message in messages %}{{ '<|' + ('user' if message['role'] == 'tool' "
        "else message['role']) + '|>' + message['content'] + '<|eos|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        super().__init__(tokenizer)
        self._role_ids = {
            "system": tokenizer.special_ids["<|system|>"],
            "user": tokenizer.special_ids["<|user|>"],
            "assistant": tokenizer.special_ids["<|assistant|>"],
            "tool": tokenizer.special_ids["<|user|>"],
        }
        self._eos = tokenizer.eos_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    def render_message(self, message: ChatMessage) -> list[int]:
        return [self._role_ids[message.role], *self.tokenizer.encode(message.content), self._eos]

    def generation_prompt(self) -> list[int]:
        return [self._role_ids["assistant"]]


class ChatMLTemplate(ChatTemplate):
    """`<|im_start|>role\\ncontent<|im_end|>\\n`, for HF tokenizers that define those tokens."""

    jinja = (
        "{% for message in messages %}{{ '<|im_start|>' + ('user' if message['role'] == 'tool' "
        "else message['role']) + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )

    def __init__(self, tokenizer: HFTokenizer) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.hf.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer has no {', '.join(missing)}: the ChatML template needs them; "
                "use a ChatML model's tokenizer (e.g. Qwen) or the byte tokenizer"
            )
        self._start = int(vocab["<|im_start|>"])
        self._end = int(vocab["<|im_end|>"])

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._end,)

    def _header(self, role: str) -> list[int]:
        return [self._start, *self.tokenizer.encode(f"{role}\n")]

    def render_message(self, message: ChatMessage) -> list[int]:
        role = "user" if message.role == "tool" else message.role
        body = self.tokenizer.encode(message.content)
        return [*self._header(role), *body, self._end, *self.tokenizer.encode("\n")]

    def generation_prompt(self) -> list[int]:
        return self._header("assistant")

    def end_of_assistant(self, generated_ids: Sequence[int]) -> list[int]:
        return [*super().end_of_assistant(generated_ids), *self.tokenizer.encode("\n")]


def chat_template_for(tokenizer: Tokenizer) -> ChatTemplate:
    """The template matching `tokenizer`; ValueError when none fits."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteChatTemplate(tokenizer)
    if isinstance(tokenizer, HFTokenizer):
        return ChatMLTemplate(tokenizer)
    raise ValueError(f"no chat template for tokenizer {type(tokenizer).__name__}")


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path) -> None:
    """Write `tokenizer`'s files and chat template into `folder` (beside a model saved
    there), so the folder loads with its own tokenizer, in rlpipe and in transformers."""
    hf = byte_tokenizer_as_hf() if isinstance(tokenizer, ByteTokenizer) else None
    if isinstance(tokenizer, HFTokenizer):
        hf = tokenizer.hf
    if hf is None:
        raise ValueError(f"cannot save tokenizer {type(tokenizer).__name__}")
    if not getattr(hf, "chat_template", None):
        # A tokenizer none of our templates fits (no ChatML tokens) is saved without one.
        with contextlib.suppress(ValueError):
            hf.chat_template = chat_template_for(tokenizer).jinja or None
    hf.save_pretrained(folder)


def with_tools(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[ChatMessage]:
    """`messages` with the tool description appended to the system message (or one added)."""
    description = describe_tools(list(tools))
    if not description:
        return list(messages)
    if messages and messages[0].role == "system":
        system = ChatMessage(role="system", content=f"{messages[0].content}\n\n{description}")
        return [system, *messages[1:]]
    return [ChatMessage(role="system", content=description), *messages]


def render_tool_results(results: Sequence[ToolResult]) -> ChatMessage:
    """One tool message holding every result of a turn, in call order."""
    blocks = []
    for result in results:
        status = f' error="{result.error}"' if result.error else ""
        blocks.append(
            f'<tool_result id="{result.call_id}" name="{result.name}"{status}>\n'
            f"{result.content}\n</tool_result>"
        )
    return ChatMessage(role="tool", content="\n".join(blocks))
