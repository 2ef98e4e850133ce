"""The sampling distribution: temperature, nucleus (top-p) and greedy, with exact logprobs.

The logprob recorded for a sampled token must be its logprob under the distribution it was
drawn from, or the trainer's importance weights are wrong. So the distribution is built
once, explicitly, as normalized fp32 logprobs, and the token is both drawn from it and
scored with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from libs.engine.base import SamplingParams


class SampledTokens(NamedTuple):
    """One decoding step for a batch of rows; every field is [B]."""

    token_ids: torch.Tensor
    """Sampled ids (int64)."""
    logprobs: torch.Tensor
    """Logprob under the sampling distribution (0.0 for greedy: a point mass)."""
    raw_logprobs: torch.Tensor
    """Logprob under the model's plain softmax (temperature 1, no top-p)."""


def nucleus_logprobs(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalized logprobs [B, V] over the smallest top set whose mass reaches `top_p`.

    Tokens outside the nucleus get -inf. The most likely token is always kept, so the
    result is a proper distribution for any top_p in (0, 1].
    """
    if top_p >= 1.0:
        return logprobs
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    sorted_probs = sorted_logprobs.exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logprobs = sorted_logprobs.masked_fill(mass_before >= top_p, float("-inf"))
    kept = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_logprobs)
    return kept.log_softmax(dim=-1)


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Normalized fp32 logprobs [B, V] of the distribution tokens are drawn from."""
    scaled = (logits.float() / temperature).log_softmax(dim=-1)
    return nucleus_logprobs(scaled, top_p)


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> SampledTokens:
    """Draw one token per row from `logits` [B, V] as `params` say, with both logprobs."""
    raw = logits.float().log_softmax(dim=-1)
    if params.is_greedy:
        token_ids = raw.argmax(dim=-1)
        picked_raw = raw.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        return SampledTokens(token_ids, torch.zeros_like(picked_raw), picked_raw)
    plain = params.temperature == 1.0 and params.top_p >= 1.0
    dist = raw if plain else sampling_logprobs(logits, params.temperature, params.top_p)
    token_ids = torch.multinomial(dist.exp(), num_samples=1, generator=generator).squeeze(-1)
    picked = dist.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    picked_raw = raw.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return SampledTokens(token_ids, picked, picked_raw)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """RNG for one `generate` call on `device`: seeded when `seed` is set, else fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
