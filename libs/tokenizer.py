"""Tokenizers: a download-free byte-level default and an adapter for local HF tokenizers.

Everything that turns text into token ids goes through the small `Tokenizer` protocol, so
the embedded default (`ByteTokenizer`, 256 byte tokens plus a few specials) and a real
tokenizer loaded from a local folder are interchangeable. Build one with
`load_tokenizer("byte")` or `load_tokenizer("/path/to/model")`.

`train_chat_tokenizer(texts, vocab_size)` trains a ChatML BPE tokenizer on text a project
makes (the warm start's demonstrations), for a model folder that carries its own tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

BYTE_TOKENIZER_SPEC = "byte"

# Specials follow the 256 byte ids, in this order; the order is part of the vocabulary,
# so changing it invalidates every model trained with the byte tokenizer.
BYTE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
NUM_BYTES = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What the policy, the engine and the services need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must embed (ids are in [0, vocab_size))."""
        ...

    @property
    def eos_id(self) -> int:
        """Id that ends a generation."""
        ...

    @property
    def pad_id(self) -> int:
        """Id used to fill padded positions (always masked out)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""
        ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special`."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the specials of `BYTE_SPECIAL_TOKENS`.

    Deterministic and needs no files, so it is the embedded default: a tiny model with this
    vocabulary learns on a laptop CPU. Decoding replaces invalid UTF-8 (a sampled byte
    sequence may be cut mid-character) with U+FFFD instead of raising.
    """

    def __init__(self) -> None:
        self.special_ids: Mapping[str, int] = {
            name: NUM_BYTES + offset for offset, name in enumerate(BYTE_SPECIAL_TOKENS)
        }
        self._id_to_special = {token_id: name for name, token_id in self.special_ids.items()}

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(BYTE_SPECIAL_TOKENS)

    @property
    def pad_id(self) -> int:
        return self.special_ids["<|pad|>"]

    @property
    def bos_id(self) -> int:
        return self.special_ids["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["<|eos|>"]

    def encode(self, text: str) -> list[int]:
        # Special-token strings in `text` stay plain bytes: user text cannot forge a role marker.
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; raises ValueError for an id outside the vocabulary."""
        pieces: list[str] = []
        pending = bytearray()
        for token_id in ids:
            if 0 <= token_id < NUM_BYTES:
                pending.append(token_id)
                continue
            if token_id not in self._id_to_special:
                raise ValueError(f"token id {token_id} is outside the byte vocabulary")
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special:
                pieces.append(self._id_to_special[token_id])
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


class HFTokenizer:
    """Adapter giving a `transformers` tokenizer the `Tokenizer` protocol."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the HF tokenizer has no eos token; set eos_token in its config")
        self.hf = tokenizer

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens, which the model must embed too; .vocab_size does not.
        return len(self.hf)

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        # Many chat models ship without a pad token; padded positions are masked, so eos serves.
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else int(pad)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))


def load_tokenizer(spec: str) -> Tokenizer:
    """Tokenizer named by `spec`: "byte" for the embedded default, else a local folder path.

    A folder is loaded with `AutoTokenizer.from_pretrained(path, local_files_only=True)`:
    nothing is ever downloaded.
    """
    if spec == BYTE_TOKENIZER_SPEC:
        return ByteTokenizer()
    if not Path(spec).is_dir():
        raise ValueError(
            f"tokenizer spec {spec!r} is neither 'byte' nor an existing local folder; "
            "pass 'byte' or the path of a folder holding tokenizer files"
        )
    if holds_byte_tokenizer(Path(spec)):
        return ByteTokenizer()
    from transformers import AutoTokenizer  # deferred: heavy, and unneeded for the default

    return HFTokenizer(AutoTokenizer.from_pretrained(spec, local_files_only=True))


def byte_vocabulary() -> dict[str, int]:
    """The byte tokenizer's vocabulary as HF byte-level tokens: GPT-2's printable character
    for each byte (`Ġ` for a space) -> the byte's value, then the specials."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    vocabulary, shifted = {}, 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            vocabulary[chr(byte)] = byte
        else:
            vocabulary[chr(NUM_BYTES + shifted)] = byte
            shifted += 1
    vocabulary.update(ByteTokenizer().special_ids)
    return vocabulary


def byte_tokenizer_as_hf() -> Any:
    """A transformers tokenizer that encodes and decodes as `ByteTokenizer` does."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bytes_only = {token: i for token, i in byte_vocabulary().items() if i < NUM_BYTES}
    raw = RawTokenizer(models.BPE(vocab=bytes_only, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=list(BYTE_SPECIAL_TOKENS[3:]),
    )


def holds_byte_tokenizer(folder: Path) -> bool:
    """True when `folder`'s tokenizer.json is the byte tokenizer that
    `libs.chat.template.save_tokenizer` writes."""
    try:
        saved = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    model = saved.get("model") or {}
    added = {t.get("content"): t.get("id") for t in saved.get("added_tokens") or []}
    vocabulary = {**(model.get("vocab") or {}), **added}
    return (
        model.get("type") == "BPE" and not model.get("merges") and vocabulary == byte_vocabulary()
    )


# The specials of `train_chat_tokenizer`: ChatML's, so libs.chat.template renders it as it
# renders a Qwen tokenizer (eos <|im_end|>, pad <|endoftext|>).
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens learnt from `texts`, with the
    ChatML specials. Every digit stays a token of its own (numbers are copied and compared
    digit by digit, the same way whatever surrounds them), and merges may cross spaces, so
    text that recurs whole (a system prompt, a tool-call frame) becomes a few tokens: on calc's
    episodes 73 tokens against 684 bytes."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < NUM_BYTES + len(CHATML_SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must hold the 256 bytes and {len(CHATML_SPECIAL_TOKENS)} specials, "
            f"got {vocab_size}"
        )
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    return HFTokenizer(hf)
