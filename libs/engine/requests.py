"""What the in-process engines (`hf`, `paged`) check and share, written once.

check_request(prompts, params, num_samples, vocab_size, max_context, limit)
staged = stage_update(live_tensors, state)       # checked, on the model's device/dtypes
hits_stop(token_ids, params, tokenizer)           # the newest token ends the completion
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from libs.engine.base import SamplingParams
from libs.tokenizer import Tokenizer

# Extra tokens decoded before a stop string's own length when looking for it, so tokenizers
# whose decode depends on the previous token (SentencePiece's leading space) still match.
STOP_STRING_CONTEXT_TOKENS = 4


def check_request(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    num_samples: int,
    vocab_size: int,
    max_context: int,
    limit: str,
) -> None:
    """Raise ValueError naming the problem if the request cannot be served; `limit` says
    what bounds `max_context` (e.g. "the model's positions")."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if any(not 0 <= token < vocab_size for prompt in prompts for token in prompt):
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    longest = max(len(prompt) for prompt in prompts)
    if longest + params.max_tokens > max_context:
        raise ValueError(
            f"longest prompt ({longest}) + max_tokens ({params.max_tokens}) exceeds the "
            f"{max_context} tokens one sequence may hold ({limit}); lower max_tokens or "
            "shorten the prompt"
        )


def stage_update(
    live: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` checked against the model's `live` tensors (names, shapes) and moved to their
    devices and dtypes: done before a swap's pause, not inside it."""
    unknown = sorted(set(state) - set(live))
    if unknown:
        raise ValueError(f"weight update names tensors the model lacks: {unknown[:5]}")
    staged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        target = live[name]
        if tensor.shape != target.shape:
            raise ValueError(
                f"weight update {name!r} has shape {tuple(tensor.shape)}, "
                f"the model has {tuple(target.shape)}"
            )
        staged[name] = tensor.to(device=target.device, dtype=target.dtype)
    return staged


def check_version(version: int, loaded: int) -> None:
    """ValueError when a weight update would move the engine back to an older version."""
    if version < loaded:
        raise ValueError(f"weight version {version} is older than the loaded version {loaded}")


def hits_stop(token_ids: Sequence[int], params: SamplingParams, tokenizer: Tokenizer) -> bool:
    """True when the newest token is eos or a stop id, or completes a stop string."""
    last = token_ids[-1]
    if last == tokenizer.eos_id or last in params.stop_token_ids:
        return True
    if not params.stop_strings:
        return False
    # A stop string of n UTF-8 bytes spans at most n tokens (each token is >= 1 byte).
    window = max(len(text.encode()) for text in params.stop_strings)
    tail = tokenizer.decode(list(token_ids[-(window + STOP_STRING_CONTEXT_TOKENS) :]))
    return any(text in tail for text in params.stop_strings)
