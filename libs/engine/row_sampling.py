"""Sampling with per-row parameters and per-row seeds, for a batch whose rows come and go.

In a continuously batched engine each row belongs to its own request, so temperature, top-p
and the random stream are per row: a row's tokens must not depend on which other rows share
its step. Sampling uses the Gumbel-max trick: argmax(logprobs + Gumbel noise) is an exact
draw from softmax(logprobs), and the noise of row r at its k-th token is a pure function of
(row seed, k), so a seeded request gives the same tokens alone or in any batch.

The recorded logprob is the token's logprob under the very distribution the noise was added
to (temperature, then nucleus renormalized, in fp32): what the trainer's importance weights
need. Greedy rows (temperature 0) take the argmax of the raw logits and record 0.0.

Two implementations of one contract:
- `sample_rows_torch`: any device; counter-hash noise; handles top-p < 1 (a sort per row group).
- `sample_rows_triton` (CUDA): one fused pass over each row's logits: raw and tempered
  log-normalizers, Philox noise (`tl.rand`) and the running argmax, for rows with top_p = 1;
  with few rows, each row's vocabulary in parallel splits combined by a second kernel (the
  noise is a function of (seed, column), so the tokens do not depend on the split).
The two draw different noise, so on CPU and GPU seeded samples differ (greedy does not).

    seeds = step_seeds(row_seeds, tokens_so_far)          # [B] int64, one per row and step
    sampled = sample_rows(logits, temperatures, top_ps, seeds)
"""

from __future__ import annotations

import torch

from libs.cuda_device import on_device_of
from libs.engine.paged_attention import HAS_TRITON
from libs.engine.sampling import SampledTokens, nucleus_logprobs

if HAS_TRITON:
    import triton
    import triton.language as tl

_MASK_31 = (1 << 31) - 1
_MASK_53 = (1 << 53) - 1


def _signed64(value: int) -> int:
    """`value` (< 2**64) as the int64 with the same bits, so torch can multiply by it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_A = _signed64(0xBF58476D1CE4E5B9)
_MIX_B = _signed64(0x94D049BB133111EB)
_GOLDEN = _signed64(0x9E3779B97F4A7C15)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping multiplies, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX_A
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX_B
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def step_seeds(row_seeds: torch.Tensor, num_generated: torch.Tensor) -> torch.Tensor:
    """Seed [B] (int64 in [0, 2**31)) of each row's next draw, from its seed and token count.

    Three elementwise ops (they run outside the CUDA graph, every step); both samplers mix
    the seed with the column index themselves (a hash, or Philox keyed by the seed)."""
    return (row_seeds * _GOLDEN + num_generated) & _MASK_31


def row_seed(request_seed: int | None, row: int, fresh: int) -> int:
    """The seed of row `row` of a request: derived from the request's seed, else `fresh`."""
    if request_seed is None:
        return fresh & ((1 << 62) - 1)
    mixed = _mix(torch.tensor([request_seed * 1_000_003 + row], dtype=torch.int64))
    return int(mixed.item()) & ((1 << 62) - 1)


def _uniform_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] in fp64, a pure function of (seed, column)."""
    columns = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix(seeds[:, None] * _GOLDEN + columns[None, :] * _MIX_B + 1)
    return (((bits >> 11) & _MASK_53).double() + 0.5) / float(1 << 53)


def sample_rows_torch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
) -> SampledTokens:
    """One token per row of `logits` [B, V] under each row's temperature and top-p [B]."""
    raw = logits.float().log_softmax(dim=-1)
    greedy = temperatures == 0
    safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    dist = (logits.float() / safe_t[:, None].float()).log_softmax(dim=-1)
    for top_p in top_ps.unique().tolist():
        if top_p < 1.0:
            rows = (top_ps == top_p).nonzero().squeeze(-1)
            dist[rows] = nucleus_logprobs(dist[rows], top_p)
    gumbel = -torch.log(-torch.log(_uniform_noise(seeds, logits.shape[-1])))
    drawn = (dist.double() + gumbel).argmax(dim=-1)
    token_ids = torch.where(greedy, raw.argmax(dim=-1), drawn)
    picked = dist.gather(-1, token_ids[:, None]).squeeze(-1)
    picked_raw = raw.gather(-1, token_ids[:, None]).squeeze(-1)
    return SampledTokens(token_ids, torch.where(greedy, 0.0, picked), picked_raw)


if HAS_TRITON:

    @triton.jit
    def _sample_kernel(  # type: ignore[no-untyped-def]
        logits_ptr,  # [B, V], any float dtype
        temperatures_ptr,  # [B] fp32, 0 = greedy
        seeds_ptr,  # [B] int64 in [0, 2**31)
        token_ptr,  # [B] int64 out (SPLITS == 1)
        logprob_ptr,  # [B] fp32 out (SPLITS == 1)
        raw_logprob_ptr,  # [B] fp32 out (SPLITS == 1)
        partial_ptr,  # [B, SPLITS, 6] fp32 out (SPLITS > 1): see _combine_samples_kernel
        vocab_size,
        logits_stride,
        split_len,  # columns per split, a multiple of TILE
        TILE: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        split = tl.program_id(1)
        temperature = tl.load(temperatures_ptr + row)
        greedy = temperature == 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
        seed = tl.load(seeds_ptr + row).to(tl.int32)
        raw_max = tl.full([TILE], float("-inf"), tl.float32)
        raw_sum = tl.zeros([TILE], tl.float32)
        t_max = tl.full([TILE], float("-inf"), tl.float32)
        t_sum = tl.zeros([TILE], tl.float32)
        best_score = tl.full([TILE], float("-inf"), tl.float32)
        best_index = tl.full([TILE], -1, tl.int32)  # -1: a lane with no valid column never wins
        best_logit = tl.zeros([TILE], tl.float32)
        begin = split * split_len
        end = tl.minimum(vocab_size, begin + split_len)
        for start in range(begin, end, TILE):
            columns = start + tl.arange(0, TILE)
            valid = columns < end
            x = tl.load(
                logits_ptr + row * logits_stride + columns, mask=valid, other=float("-inf")
            ).to(tl.float32)
            # Per lane online log-sum-exp, for the raw and the tempered distribution.
            new_max = tl.maximum(raw_max, x)
            raw_sum = raw_sum * tl.exp(raw_max - new_max) + tl.where(
                valid, tl.exp(x - new_max), 0.0
            )
            raw_sum = tl.where(new_max == float("-inf"), 0.0, raw_sum)
            raw_max = new_max
            xt = x * inv_t
            new_t_max = tl.maximum(t_max, xt)
            t_sum = t_sum * tl.exp(t_max - new_t_max) + tl.where(valid, tl.exp(xt - new_t_max), 0.0)
            t_sum = tl.where(new_t_max == float("-inf"), 0.0, t_sum)
            t_max = new_t_max
            # The noise of a column depends on (seed, column) only: the same in any split.
            uniform = tl.rand(seed, columns)
            uniform = tl.minimum(tl.maximum(uniform, 1e-12), 1.0 - 1e-7)
            gumbel = -tl.log(-tl.log(uniform))
            score = tl.where(greedy, x, xt + gumbel)
            score = tl.where(valid, score, float("-inf"))
            better = score > best_score  # strict: the first column wins a tie within a lane
            best_score = tl.where(better, score, best_score)
            best_index = tl.where(better, columns, best_index)
            best_logit = tl.where(better, x, best_logit)
        # Combine the lanes: the best score, lowest column on ties (as torch.argmax).
        top = tl.max(best_score, axis=0)
        winner = tl.min(tl.where(best_score == top, best_index, vocab_size), axis=0)
        logit = tl.max(tl.where(best_index == winner, best_logit, float("-inf")), axis=0)
        lane_max = tl.max(raw_max, axis=0)
        raw_lse = lane_max + tl.log(tl.sum(raw_sum * tl.exp(raw_max - lane_max), axis=0))
        lane_t_max = tl.max(t_max, axis=0)
        t_lse = lane_t_max + tl.log(tl.sum(t_sum * tl.exp(t_max - lane_t_max), axis=0))
        if SPLITS == 1:
            tl.store(token_ptr + row, winner.to(tl.int64))
            tl.store(raw_logprob_ptr + row, logit - raw_lse)
            tl.store(logprob_ptr + row, tl.where(greedy, 0.0, logit * inv_t - t_lse))
        else:
            # A split past the vocabulary's end (rounding) reports nothing: -inf everywhere.
            empty = begin >= vocab_size
            raw_lse = tl.where(empty, float("-inf"), raw_lse)
            t_lse = tl.where(empty, float("-inf"), t_lse)
            part = partial_ptr + (row * SPLITS + split) * 6
            tl.store(part, top)
            tl.store(part + 1, winner.to(tl.float32))  # exact: columns < 2**24
            tl.store(part + 2, logit)
            tl.store(part + 3, raw_lse)
            tl.store(part + 4, t_lse)

    @triton.jit
    def _combine_samples_kernel(  # type: ignore[no-untyped-def]
        partial_ptr,  # [B, SPLITS, 6] fp32: best score, its column, its logit, raw lse, t lse
        temperatures_ptr,
        token_ptr,
        logprob_ptr,
        raw_logprob_ptr,
        vocab_size,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        temperature = tl.load(temperatures_ptr + row)
        greedy = temperature == 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
        splits = tl.arange(0, SPLITS)
        part = partial_ptr + (row * SPLITS + splits) * 6
        scores = tl.load(part)
        columns = tl.load(part + 1).to(tl.int32)
        logits = tl.load(part + 2)
        raw_lses = tl.load(part + 3)
        t_lses = tl.load(part + 4)
        top = tl.max(scores, axis=0)
        winner = tl.min(tl.where(scores == top, columns, vocab_size), axis=0)
        logit = tl.max(tl.where(columns == winner, logits, float("-inf")), axis=0)
        raw_top = tl.max(raw_lses, axis=0)
        raw_lse = raw_top + tl.log(tl.sum(tl.exp(raw_lses - raw_top), axis=0))
        t_top = tl.max(t_lses, axis=0)
        t_lse = t_top + tl.log(tl.sum(tl.exp(t_lses - t_top), axis=0))
        tl.store(token_ptr + row, winner.to(tl.int64))
        tl.store(raw_logprob_ptr + row, logit - raw_lse)
        tl.store(logprob_ptr + row, tl.where(greedy, 0.0, logit * inv_t - t_lse))


SAMPLE_TILE = 2048


def vocab_splits(num_rows: int, vocab_size: int, num_sms: int) -> int:
    """Vocabulary splits per row so that rows x splits fills about two waves of the GPU
    (a few rows would otherwise leave most multiprocessors idle), each split a tile at least."""
    tiles = -(-vocab_size // SAMPLE_TILE)
    wanted = -(-2 * num_sms // max(num_rows, 1))
    splits = 1
    while splits * 2 <= min(wanted, tiles, 32):
        splits *= 2
    return splits


def sample_rows_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> SampledTokens:
    """`sample_rows_torch` for rows with top_p = 1, fused into one pass on a CUDA device
    (each row's vocabulary in parallel splits when the rows alone would not fill the GPU)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    raw_logprobs = torch.empty_like(logprobs)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = vocab_splits(num_rows, vocab_size, num_sms)
    tiles = -(-vocab_size // SAMPLE_TILE)
    tiles_per_split = -(-tiles // splits)
    partial = (
        torch.empty((num_rows, splits, 6), dtype=torch.float32, device=device)
        if splits > 1
        else logprobs
    )
    with on_device_of(logits):
        _sample_kernel[(num_rows, splits)](
            logits,
            temperatures,
            seeds,
            token_ids,
            logprobs,
            raw_logprobs,
            partial,
            vocab_size,
            logits.stride(0),
            tiles_per_split * SAMPLE_TILE,
            TILE=SAMPLE_TILE,
            SPLITS=splits,
            num_warps=8,
        )
        if splits > 1:
            _combine_samples_kernel[(num_rows,)](
                partial, temperatures, token_ids, logprobs, raw_logprobs, vocab_size, SPLITS=splits
            )
    return SampledTokens(token_ids, logprobs, raw_logprobs)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    *,
    all_top_p_one: bool,
) -> SampledTokens:
    """One token per row: the fused kernel on CUDA when no row uses top-p, else torch."""
    if HAS_TRITON and logits.is_cuda and all_top_p_one:
        return sample_rows_triton(logits, temperatures, seeds)
    return sample_rows_torch(logits, temperatures, top_ps, seeds)
