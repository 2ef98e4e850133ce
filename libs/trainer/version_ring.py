"""The weights of the trainer's last few versions, and the train/inference mismatch of every
sampled token scored under the exact version that generated it.

    exact = setup_exact_mismatch(config)          # None: off (trainer.mismatch_exact_every_steps)
    exact.keep(version, model)                    # before each step: the weights of `version`
    if exact.due():
        result = exact.measure(model, samples, version, config, pad_id, equivalent)
    result.by_gap["1"]        # MismatchStats of the tokens one version behind the trainer
    result.num_unscored       # sampled tokens whose version is no longer kept

Why: the trainer's own logprobs under its current weights match the engine's only on tokens
of that version, which a pipelined run rarely trains on; on older tokens the difference adds
the updates since (the off-policy part, libs.rl.mismatch.mismatch_by_staleness). Scoring each
token under the weights of the version that sampled it leaves numerics alone, on every token.

Cost, stated:
- memory: `mismatch_versions_kept` copies of the master weights, on the model's card while
  they fit a quarter of its free memory, else in pinned host memory: K x the model's bytes
  (the tiny CPU policy: well under 1 MB each; byte-0.5b with fp32 masters: about 2 GB each,
  9 on the card at the default staleness bound). The slots are allocated once and reused.
- each step: one copy of the master weights into the oldest slot, queued on the stream
  (card to card, or card to host), no wait;
- each measured step (every `mismatch_exact_every_steps` steps): the batch is laid out again
  and each version present in it is scored by one no-grad forward over the rows holding its
  tokens, with that version's weights copied to the device for the forward (transiently one
  more copy of the weights there). Rows hold one version each in a one-turn task (a turn
  that spans a swap: its row is scored once per version, each token under the version that
  sampled it, Turn.version_switches), so about one no-grad forward of the batch, besides
  the step's proximal forward, forward and backward: on the 2-core CPU demo a measured step
  takes a third longer (docs/runs.md).

The forward is the step's own (libs.trainer.step._logprobs_no_grad) on the training model,
its parameters swapped for the version's in place of the module attributes for the duration
(torch's functional_call mechanism): neither the training parameters nor the optimizer see
it, and what the step's forward does the scoring does too: an MoE policy's recorded routing
is replayed as `router_replay` says (libs.trainer.router_replay). Only the 1-rank learner
measures it: a sharded model's parameters are shards (refused with N ranks,
libs.trainer.ranks.refuse_unsupported).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import torch
from torch.nn.utils.stateless import _reparametrize_module
from transformers import PreTrainedModel

from libs.policy import parameter_bytes
from libs.rl.batch import NO_VERSION, TrainBatch
from libs.rl.mismatch import ExactVersionMismatch, mismatch_by_gap, token_staleness
from libs.trainer.config import TrainerConfig
from libs.trainer.host_memory import HostCopy
from libs.trainer.step import _logprobs_no_grad, prepare_batch
from proto.messages import ScoredRollout, Turn

# Measured steps by default: every 4th. On the 2-core CPU demo a measured step takes a third
# longer than the others, so about +8% on the mean step time (docs/runs.md).
DEFAULT_EVERY_STEPS = 4
# token_versions entry of a turn that spans a weight swap without version_switches: its
# tokens' versions are unknown.
MIXED_VERSION = -2


# The ring lives on the model's card while all its versions take at most this share of the
# card's free memory when the first is kept (byte-0.5b's fp32 weights: 9 versions, 18 GB).
RING_ON_CARD_FREE_FRACTION = 0.25


class CardCopy(HostCopy):
    """HostCopy's buffers on the copied tensors' own card."""

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like, memory_format=torch.contiguous_format)


def ring_on_card(model: torch.nn.Module, num_versions: int) -> bool:
    """Whether `num_versions` copies of `model`'s parameters go on its card (a CUDA model
    whose copies fit RING_ON_CARD_FREE_FRACTION of the card's free memory)."""
    first = next(model.parameters())
    if not first.is_cuda:
        return False
    size = num_versions * parameter_bytes(model)
    free, _ = torch.cuda.mem_get_info(first.device)
    return size <= RING_ON_CARD_FREE_FRACTION * free


class VersionRing:
    """The master weights (parameters) of the last `num_versions` versions kept, oldest
    replaced first: on the model's card when they fit (`ring_on_card`, decided at the first
    keep), in pinned host memory otherwise.

    A keep queues its copies on the current stream and returns: no wait for the GPU. The
    optimizer step queued after it on the same stream cannot overwrite a parameter before
    its copy has read it, and a scoring forward reads the copies after them. Why: a
    blocking copy per parameter (~290 a step for byte-0.5b) would make the step wait for the
    GPU that many times, and a host copy of the whole model every step crosses the bus."""

    def __init__(self, num_versions: int) -> None:
        if num_versions < 1:
            raise ValueError(f"the version ring needs room for a version, got {num_versions}")
        self.num_versions = num_versions
        self.on_card: bool | None = None  # decided at the first keep
        self._slots: OrderedDict[int, HostCopy] = OrderedDict()
        self._weights: dict[int, dict[str, torch.Tensor]] = {}

    def keep(self, version: int, model: torch.nn.Module) -> None:
        """Copy `model`'s parameters as the weights of `version` (again if already kept)."""
        if self.on_card is None:
            self.on_card = ring_on_card(model, self.num_versions)
        slot = self._slots.pop(version, None)
        if slot is None and len(self._slots) >= self.num_versions:
            oldest, slot = self._slots.popitem(last=False)
            del self._weights[oldest]
        slot = slot or (CardCopy() if self.on_card else HostCopy())
        copies = {}
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                buffer = slot.buffer(name, parameter)
                copies[name] = buffer.copy_(parameter.detach(), non_blocking=True)
        self._weights[version] = copies
        self._slots[version] = slot

    def weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The parameters of `version` by name; None when it is not kept."""
        return self._weights.get(version)

    @property
    def versions(self) -> list[int]:
        """The versions kept, oldest first."""
        return list(self._slots)


@contextmanager
def at_version(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """`model` computing with `weights` (parameters by name) for the duration; its own
    parameter objects, and so the optimizer's state, are untouched and back afterwards."""
    device = next(model.parameters()).device
    on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in weights.items()}
    with _reparametrize_module(model, on_device, tie_weights=True):
        yield


def score_exact_versions(
    model: PreTrainedModel,
    batch: TrainBatch,
    ring: VersionRing,
    router_replay: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logprob [B, T-1] of each sampled token under the weights of the version
    that generated it, and the [B, T-1] mask of the tokens scored (their version kept): one
    no-grad forward per version kept, over the rows that hold its tokens, by the step's own
    forward (MoE routing replayed as `router_replay` says, libs.trainer.router_replay)."""
    logprobs = torch.zeros_like(batch.behavior_logprobs)
    scored = torch.zeros_like(batch.loss_mask)
    for version in batch.token_versions.unique().tolist():
        weights = ring.weights(version) if version >= 0 else None
        if weights is None:
            continue
        tokens = batch.token_versions == version
        rows = tokens.any(dim=1).nonzero().squeeze(1)
        with at_version(model, weights):
            scored_rows = _logprobs_no_grad(model, batch, rows, router_replay)
        logprobs[rows] = torch.where(tokens[rows], scored_rows, logprobs[rows])
        scored |= tokens
    return logprobs, scored


def mark_mixed_turns(samples: list[ScoredRollout]) -> list[ScoredRollout]:
    """`samples` with each turn that spans a weight swap (policy_version_end set) without
    saying which token each version sampled (no version_switches: an older worker) labeled
    MIXED_VERSION. A turn with switches keeps them: each token is scored under its own."""

    def marked(turn: Turn) -> Turn:
        if not _versions_unknown(turn):
            return turn
        return msgspec.structs.replace(turn, policy_version=MIXED_VERSION)

    def relabel(sample: ScoredRollout) -> ScoredRollout:
        rollout = sample.rollout
        if not any(_versions_unknown(turn) for turn in rollout.turns):
            return sample
        turns = [marked(turn) for turn in rollout.turns]
        marked_rollout = msgspec.structs.replace(rollout, turns=turns)
        return msgspec.structs.replace(sample, rollout=marked_rollout)

    return [relabel(sample) for sample in samples]


def _versions_unknown(turn: Turn) -> bool:
    """Whether `turn` spans a weight swap without saying where (see `mark_mixed_turns`)."""
    spans = turn.policy_version_end not in (None, turn.policy_version)
    return spans and not turn.version_switches


class ExactMismatchMeter:
    """The version ring and how often a step's batch is scored with it."""

    def __init__(self, every_steps: int, num_versions: int) -> None:
        self.every_steps = every_steps
        self.ring = VersionRing(num_versions)
        self._steps = 0

    def keep(self, version: int, model: torch.nn.Module) -> None:
        """Keep the weights `model` holds as `version` (call before stepping on them)."""
        self.ring.keep(version, model)

    def due(self) -> bool:
        """Whether this offline step is measured (counts the step)."""
        self._steps += 1
        return self._steps % self.every_steps == 0

    def measure(
        self,
        model: PreTrainedModel,
        samples: list[ScoredRollout],
        trainer_version: int,
        config: TrainerConfig,
        pad_id: int,
        equivalent: Callable[[int], int] | None = None,
    ) -> ExactVersionMismatch:
        """The mismatch of every sampled token of `samples` (trained or context) under its
        own version, by its gap to `trainer_version` (`equivalent`: across resumes)."""
        _, batch = prepare_batch(model, mark_mixed_turns(samples), config, pad_id)
        logprobs, scored = score_exact_versions(model, batch, self.ring, config.router_replay)
        sampled = batch.token_versions != NO_VERSION
        gap = token_staleness(batch.token_versions, trainer_version, equivalent)
        band = config.importance_weight_cap
        return ExactVersionMismatch(
            by_gap=mismatch_by_gap(logprobs, batch.behavior_logprobs, gap, scored, band),
            num_unscored=int((sampled & ~scored).sum()),
        )


def setup_exact_mismatch(config: TrainerConfig) -> ExactMismatchMeter | None:
    """The meter a 1-rank trainer's config asks for (None: off). Unset, it measures every
    DEFAULT_EVERY_STEPS steps and keeps the versions the staleness bound can train on (the
    pacer's highest bound when pacing is on)."""
    every = config.mismatch_exact_every_steps
    every = DEFAULT_EVERY_STEPS if every is None else every
    if every == 0:
        return None
    return ExactMismatchMeter(every, config.mismatch_versions_kept or versions_needed(config))


def versions_needed(config: TrainerConfig) -> int:
    """Versions a trained token can come from: the trainer's and `max_staleness` before it."""
    bound = config.max_staleness or 0
    if config.pacing.enabled:
        bound = max(bound, config.pacing.max_staleness or 0)
    return bound + 1
