"""The SFT loss: mean negative log-likelihood of the assistant tokens of a batch.

Transcripts of one environment share a long opening (the system prompt with the tool list is
~1,200 of calc's ~1,250 byte tokens), so the batch's longest common prefix is run once, its
KV cache repeated for every row, and only the rows' own suffixes are run on top of it. The
math is the plain causal forward's (same positions, same keys; checked in tests), the work
about a batch-size fraction of it.

    loss, confident = sft_loss(model, examples, pad_id)   # scalar tensor, float
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from libs.policy import sequence_logprobs, token_logprobs

MIN_SHARED_PREFIX_TOKENS = 32  # below this the plain forward is as cheap


@dataclass
class Example:
    """One rendered transcript: ids and the assistant-token mask, same length."""

    ids: list[int]
    mask: list[int]


def batch_tensors(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, loss_mask), each [B, T], right-padded."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, example in enumerate(examples):
        n = len(example.ids)
        ids[row, :n] = torch.tensor(example.ids)
        attention[row, :n] = 1
        loss[row, :n] = torch.tensor(example.mask, dtype=torch.float32)
    return ids, attention, loss


def shared_prefix_length(examples: Sequence[Example]) -> int:
    """Tokens every row starts with, none of them trained on, leaving each row >= 1 token."""
    first = examples[0].ids
    limit = min(len(e.ids) for e in examples) - 1
    length = 0
    while (
        length < limit
        and all(e.ids[length] == first[length] for e in examples)
        and not any(e.mask[length] for e in examples)
    ):
        length += 1
    return length


def sft_loss(
    model: PreTrainedModel, examples: Sequence[Example], pad_id: int
) -> tuple[torch.Tensor, float]:
    """Mean NLL of the masked (assistant) tokens, and the share of them the model gives more
    than half its probability (a lower bound of greedy token accuracy)."""
    # The prefix's last token stays in the suffix: it holds the first suffix target's logits.
    prefix = shared_prefix_length(examples) - 1
    if prefix < MIN_SHARED_PREFIX_TOKENS:
        ids, attention, loss_mask = (t.to(model.device) for t in batch_tensors(examples, pad_id))
        logprobs = sequence_logprobs(model, ids, attention)  # [B, T-1]: t scores ids[:, t+1]
        return _mean_nll(logprobs, loss_mask[:, 1:])
    return _mean_nll(*_suffix_logprobs(model, examples, prefix, pad_id))


def _suffix_logprobs(
    model: PreTrainedModel, examples: Sequence[Example], prefix: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [B, S-1] of each row's suffix tokens after the shared `prefix`, and their
    loss mask, with the prefix's keys and values computed once."""
    device = model.device
    head = torch.tensor([examples[0].ids[:prefix]], device=device)
    cache = model(input_ids=head, use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(examples))
    tails = [Example(e.ids[prefix:], e.mask[prefix:]) for e in examples]
    ids, attention, loss_mask = (t.to(device) for t in batch_tensors(tails, pad_id))
    rows, width = ids.shape
    full_attention = torch.cat([attention.new_ones(rows, prefix), attention], dim=1)
    positions = (prefix + torch.arange(width, device=device)).expand(rows, -1)
    outputs = model(
        input_ids=ids,
        attention_mask=full_attention,
        position_ids=positions,
        use_cache=False,
        **{_cache_kwarg(model): cache},
    )
    logprobs = token_logprobs(outputs.logits[:, :-1], ids[:, 1:])
    return logprobs, loss_mask[:, 1:] * attention[:, 1:]


def _mean_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    count = targets.sum()
    loss = -(logprobs * targets).sum() / count
    confident = ((logprobs.detach() > math.log(0.5)).float() * targets).sum() / count
    return loss, float(confident)


def _cache_kwarg(model: PreTrainedModel) -> str:
    """`cache` from transformers ~5.2x on, `past_key_values` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
