"""A model folder as a user brings one, built here with nothing downloaded.

    folder = build_model_folder(tmp_path / "model")

A Qwen2-style causal LM (random init, a few layers) saved with `save_pretrained`, beside its
own byte-level BPE tokenizer trained locally with the `tokenizers` library (ChatML specials
`<|im_start|>` / `<|im_end|>`, eos `<|im_end|>`, a chat template in tokenizer_config.json),
so ids differ from the byte tokenizer's and the vocabulary is larger than 262.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 1024


def corpus() -> list[str]:
    """Text the tokenizer learns merges from: sums, tool calls, chat words."""
    lines = [f"{a}+{b}={a + b}" for a in range(0, 100, 3) for b in range(0, 100, 7)]
    lines += [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_result id="call-0" name="add">5</tool_result>',
        "system\nuser\nassistant\nYou are a helpful assistant. Summarize your progress.",
        "The answer is 42. What is the sum of these numbers? Use the tools.",
    ] * 20
    return lines


def build_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus()` and save it (with its chat template)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_model_folder(folder: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A Qwen2-style model folder with its own tokenizer; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
