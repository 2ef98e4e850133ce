"""Online samples (served generation + product feedback) -> rewards, advantages and tensors.

    rewards = check_signal_rewards(settings.online_signal_rewards)   # at start: all signals
    split = split_online_by_staleness(samples, trainer_version=9, max_staleness=8)
    advantages = online_advantages(split.kept, rewards, baselines, decay=0.9, key="context_kind")
    batch = build_online_batch(split.kept, advantages.advantages, pad_id=tokenizer.pad_id)
    loss, stats = ppo_clip_loss(new, prox, batch.behavior_logprobs, batch.advantages,
                                batch.loss_mask)        # libs.rl.loss: truncated IS weights

An online sample is one completion per prompt (no GRPO group), so its advantage is taken
against a running baseline instead of its group's mean: advantage = reward - baseline, where
the baseline is a running mean of earlier rewards of the same context kind, and is updated
with a sample's reward only after that sample used it (a sample never baselines itself).

- Reward: the product's signal mapped by the trainer's configuration (`signal_reward`); the
  event's optional `value` is not used. The mapping must name every FeedbackSignal, so no
  sample can arrive that the trainer cannot score.
- Context kind: `<feedback.product>:<generation.metadata[key]>` (the key configurable,
  default `context_kind`; a missing entry is ""), so products and kinds of request (chat,
  code completion, ...) with different reward levels do not share a baseline.
- Baseline: the mean of the kind's rewards so far for its first 1 / (1 - decay) samples,
  then an exponential moving average, weight (1 - decay) on the newest reward; 0 before any.
  Within a batch, samples are taken in stream order. The state is a msgspec struct, saved
  with the trainer's checkpoint.
- Tensors: the prompt then the completion, right-padded; only completion tokens are
  trained (`loss_mask`); their behavior logprobs are the served logprobs and their
  versions the served `policy_version`, so libs.rl.loss corrects with the truncated
  importance weight min(exp(trainer - served), cap), as for offline rollouts.
- Staleness: trainer version - served version; 0 <= staleness <= max_online_staleness is
  kept, older (and newer) dropped and counted, as in libs.rl.staleness.

Tested on CPU against hand-computed references in tests/test_online_rl.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import get_args

import msgspec
import torch

from libs.moe.wire import decode_routing
from libs.rl.batch import NO_VERSION, TrainBatch, pad_rows, routing_tensor
from libs.rl.staleness import staleness_histogram
from proto.messages import FeedbackSignal, OnlineSample
from proto.version_switches import token_versions

ALL_SIGNALS: tuple[str, ...] = get_args(FeedbackSignal)

# The default mapping: acceptance is the product's strongest everyday signal; a rejection
# costs less than an acceptance earns, because users reject for reasons besides quality.
DEFAULT_SIGNAL_REWARDS: dict[str, float] = {
    "accepted": 0.75,
    "edited": 0.25,
    "thumbs_up": 0.5,
    "ignored": 0.0,
    "rejected": -0.25,
    "thumbs_down": -0.5,
}
DEFAULT_CONTEXT_KEY = "context_kind"


def check_signal_rewards(rewards: Mapping[str, float]) -> dict[str, float]:
    """`rewards` as a dict, or ValueError naming the signals missing from it or unknown."""
    missing = [signal for signal in ALL_SIGNALS if signal not in rewards]
    unknown = sorted(set(rewards) - set(ALL_SIGNALS))
    if missing or unknown:
        raise ValueError(
            f"online signal rewards: missing {missing}, unknown {unknown}; give a reward "
            f"for each of {list(ALL_SIGNALS)} (0 for a signal that says nothing)"
        )
    bad = {signal: value for signal, value in rewards.items() if not _finite(value)}
    if bad:
        raise ValueError(f"online signal rewards must be finite numbers, got {bad}")
    return dict(rewards)


def signal_reward(signal: str, rewards: Mapping[str, float]) -> float:
    """The reward of a feedback `signal`; ValueError when the mapping has none for it."""
    if signal not in rewards:
        raise ValueError(
            f"feedback signal {signal!r} has no reward in the online signal rewards "
            f"(mapped: {sorted(rewards)}); add it to the trainer's online_signal_rewards"
        )
    return rewards[signal]


def context_kind(sample: OnlineSample, key: str = DEFAULT_CONTEXT_KEY) -> str:
    """`<product>:<metadata[key]>`: the group of samples that share a baseline."""
    return f"{sample.feedback.product}:{sample.generation.metadata.get(key, '')}"


class OnlineBaselines(msgspec.Struct, kw_only=True):
    """Running reward baseline per context kind (saved in the trainer's checkpoint)."""

    values: dict[str, float] = msgspec.field(default_factory=dict)
    counts: dict[str, int] = msgspec.field(default_factory=dict)

    def value(self, kind: str) -> float:
        """The kind's baseline now; 0 before its first reward."""
        return self.values.get(kind, 0.0)

    def update(self, kind: str, reward: float, decay: float) -> None:
        """Fold `reward` in: running mean while count < 1 / (1 - decay), then the EMA."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"baseline decay must be in [0, 1), got {decay}")
        count = self.counts.get(kind, 0) + 1
        weight = max(1.0 - decay, 1.0 / count)
        self.values[kind] = self.value(kind) + weight * (reward - self.value(kind))
        self.counts[kind] = count


@dataclass(frozen=True)
class OnlineAdvantages:
    """Per-sample rewards, baselines used and advantages, in input order."""

    rewards: list[float]
    baselines: list[float]
    kinds: list[str]
    advantages: torch.Tensor  # [N] float32, reward - baseline

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def online_advantages(
    samples: Sequence[OnlineSample],
    rewards: Mapping[str, float],
    baselines: OnlineBaselines,
    *,
    decay: float,
    context_key: str = DEFAULT_CONTEXT_KEY,
) -> OnlineAdvantages:
    """reward - baseline for each sample in order, updating `baselines` after each use."""
    rewards_out: list[float] = []
    used: list[float] = []
    kinds: list[str] = []
    for sample in samples:
        kind = context_kind(sample, context_key)
        reward = signal_reward(sample.feedback.signal, rewards)
        rewards_out.append(reward)
        used.append(baselines.value(kind))
        kinds.append(kind)
        baselines.update(kind, reward, decay)
    advantages = [r - b for r, b in zip(rewards_out, used, strict=True)]
    return OnlineAdvantages(rewards_out, used, kinds, torch.tensor(advantages, dtype=torch.float32))


def online_sample_problem(sample: OnlineSample) -> str | None:
    """Why `sample` cannot be trained on, or None when it can."""
    generation = sample.generation
    if not generation.training_eligible:
        return "generation is not training-eligible"
    if not generation.completion_token_ids:
        return "empty completion"
    if not generation.prompt_token_ids:
        return "empty prompt (the first completion token would have no prefix)"
    if len(generation.logprobs) != len(generation.completion_token_ids):
        return (
            f"{len(generation.completion_token_ids)} completion tokens but "
            f"{len(generation.logprobs)} logprobs; serving must record one per token"
        )
    if not all(_finite(lp) and lp <= 0.0 for lp in generation.logprobs):
        return "served logprobs must be finite and <= 0"
    return None


def build_online_batch(
    samples: Sequence[OnlineSample],
    advantages: torch.Tensor | Sequence[float],
    *,
    pad_id: int,
    max_length: int | None = None,
) -> TrainBatch:
    """Padded [B, T] tensors of prompt + completion, completion tokens trained.

    Rows cut to `max_length` keep the prompt and lose the completion's end (counted in
    `num_truncated`). ValueError for an empty batch, a count mismatch, or a sample
    `online_sample_problem` refuses (naming it).
    """
    if not samples:
        raise ValueError("build_online_batch needs at least one sample")
    if len(advantages) != len(samples):
        raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples")
    for sample in samples:
        problem = online_sample_problem(sample)
        if problem is not None:
            raise ValueError(f"online sample {sample.sample_id!r}: {problem}")
    rows = [_layout(sample) for sample in samples]
    num_truncated = sum(max_length is not None and len(row[0]) > max_length for row in rows)
    if max_length is not None:
        rows = [(ids[:max_length], gen[:max_length], lps[:max_length]) for ids, gen, lps in rows]
    width = max(len(row[0]) for row in rows)
    versions = [_versions(sample, len(row[0])) for sample, row in zip(samples, rows, strict=True)]
    return TrainBatch(
        input_ids=pad_rows([row[0] for row in rows], width, pad_id, torch.long),
        attention_mask=pad_rows([[1] * len(row[0]) for row in rows], width, 0, torch.long),
        # Shift by one: entry t of a [B, T-1] tensor is about token t+1.
        loss_mask=pad_rows([row[1][1:] for row in rows], width - 1, False, torch.bool),
        behavior_logprobs=pad_rows([row[2][1:] for row in rows], width - 1, 0.0, torch.float32),
        token_versions=pad_rows(versions, width - 1, NO_VERSION, torch.long),
        advantages=torch.as_tensor(advantages, dtype=torch.float32).detach().cpu().clone(),
        sample_ids=[sample.sample_id for sample in samples],
        num_truncated=num_truncated,
        routed_experts=routing_tensor([_routing(sample) for sample in samples], width),
    )


def _versions(sample: OnlineSample, length: int) -> list[int]:
    """The version that sampled each of tokens 1..length-1 of prompt + completion (the
    batch's shifted layout); NO_VERSION for prompt tokens."""
    generation = sample.generation
    completion = token_versions(
        generation.policy_version,
        generation.version_switches,
        len(generation.completion_token_ids),
    )
    return ([NO_VERSION] * len(generation.prompt_token_ids) + completion)[1:length]


def _routing(sample: OnlineSample) -> tuple[list[int], list[torch.Tensor]]:
    """The sample's routing pieces as `routing_tensor` takes them (from position 0)."""
    routed = sample.generation.routed_experts
    return ([], []) if routed is None else ([0], [decode_routing(routed)])


def _layout(sample: OnlineSample) -> tuple[list[int], list[bool], list[float]]:
    """(token ids, generated flag, behavior logprob) per token of prompt + completion."""
    generation = sample.generation
    num_prompt = len(generation.prompt_token_ids)
    return (
        [*generation.prompt_token_ids, *generation.completion_token_ids],
        [False] * num_prompt + [True] * len(generation.completion_token_ids),
        [0.0] * num_prompt + list(generation.logprobs),
    )


@dataclass
class OnlineSplit:
    """Online samples within the staleness bound, and those outside it."""

    kept: list[OnlineSample] = field(default_factory=list)
    dropped: list[OnlineSample] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    """Staleness of every input sample (kept and dropped), in input order."""

    @property
    def histogram(self) -> dict[int, int]:
        return staleness_histogram(self.staleness)


def online_staleness(
    sample: OnlineSample, trainer_version: int, equivalent: Callable[[int], int] | None = None
) -> int:
    """trainer_version - the served version; negative for a version the trainer never had.
    `equivalent` as in libs.rl.staleness.sample_staleness (after a resume)."""
    version = sample.generation.policy_version
    return trainer_version - (equivalent(version) if equivalent is not None else version)


def split_online_by_staleness(
    samples: Iterable[OnlineSample], trainer_version: int, max_staleness: int
) -> OnlineSplit:
    """Samples with 0 <= staleness <= `max_staleness` kept, the rest dropped, order kept."""
    if max_staleness < 0:
        raise ValueError(f"max_online_staleness must be >= 0, got {max_staleness}")
    split = OnlineSplit()
    for sample in samples:
        staleness = online_staleness(sample, trainer_version)
        split.staleness.append(staleness)
        (split.kept if 0 <= staleness <= max_staleness else split.dropped).append(sample)
    return split


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
