"""A tokenizer of the policy's own, trained on the SFT transcripts it will learn from.

    rlpipe sft --data demos.jsonl --out models/calc-sft --train-tokenizer 1024 ...

or `ensure_transcript_tokenizer(Path("demos.jsonl"), Path("models/tok"), 1024)`. The text of
every message (tool list, calls and results included, as the template lays them out) trains
a ChatML byte-level BPE tokenizer (libs.tokenizer.train_chat_tokenizer); a random-init policy
built over it then reads an episode in far fewer tokens than over bytes (calc: 73 against
684), which makes every SFT and RL step cheaper. Model folders trained from it carry it.
"""

from __future__ import annotations

from pathlib import Path

from libs.chat.template import save_tokenizer
from libs.sft.transcript import iter_transcripts, transcript_texts
from libs.tokenizer import train_chat_tokenizer


def ensure_transcript_tokenizer(data: Path, folder: Path, vocab_size: int) -> Path:
    """`folder`, holding a tokenizer of at most `vocab_size` tokens trained on the transcripts
    of `data` (TranscriptError on a malformed line); an existing one is kept."""
    if (folder / "tokenizer.json").exists():
        return folder
    texts = (text for transcript in iter_transcripts(data) for text in transcript_texts(transcript))
    tokenizer = train_chat_tokenizer(texts, vocab_size)
    partial = folder.with_name(folder.name + ".partial")
    save_tokenizer(tokenizer, partial)
    partial.rename(folder)
    return folder
