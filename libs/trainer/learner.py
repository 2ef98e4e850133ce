"""The learner: the policy being trained, its optimizer, and the operations on them.

    learner = setup_learner(config, policy, tokenizer)  # 1 rank, or N under torchrun
    learner.config                      # the config sized for the model (learning rate, bound)
    learner.load(checkpoint_folder)     # resume: weights and optimizer state
    stats = learner.train(samples, version, lineage, max_staleness=4)   # one step (blocking)
    state = learner.published_state()   # the weights as workers run them, a copy
    learner.write_tensors(folder)       # the checkpoint's tensors

`LocalLearner` holds the whole model in this process. `RankLearner` (libs.trainer.ranks)
holds rank 0's shard of an FSDP2 model and runs each operation on every rank of the job.
Which one a trainer gets is configuration (torchrun's WORLD_SIZE), not a subclass: both
satisfy the `Learner` protocol, and the trainer loop (libs.trainer.loop) calls only that.

The blocking methods (train, load, published_state, write_tensors, ...) are called from a
worker thread; the ones that compute enter the trainer's compute precision themselves
(autocast state is per thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from transformers import PreTrainedModel

from libs.policy import PolicyConfig, check_vocabulary
from libs.rl import turn_trainable
from libs.rl.online import OnlineBaselines
from libs.tokenizer import Tokenizer
from libs.trainer.checkpoint import (
    host_snapshot_writer,
    load_optimizer_state,
    write_model_and_optimizer,
)
from libs.trainer.config import TrainerConfig
from libs.trainer.host_memory import HostCopy
from libs.trainer.lineage import Lineage
from libs.trainer.online_step import OnlineStepStats, train_online_step
from libs.trainer.precision import TrainingPrecision
from libs.trainer.ranks import RankLearner, world_size
from libs.trainer.reference import setup_reference
from libs.trainer.refusals import find_failing_samples
from libs.trainer.schedule import learning_rate_at, learning_rate_of
from libs.trainer.step import StepStats, train_step
from libs.trainer.version_ring import setup_exact_mismatch
from proto.messages import OnlineSample, ScoredRollout

T = TypeVar("T")


class Learner(Protocol):
    """What the trainer loop does to the policy it trains."""

    config: TrainerConfig  # sized for the model (TrainerConfig.sized_for)
    model: PreTrainedModel  # this process's model (a shard of it with N ranks)
    # Its AdamW (rank 0's with N ranks: each step sends its learning rate to every rank).
    optimizer: torch.optim.Optimizer

    def load(self, folder: Path) -> None:
        """Take the weights and optimizer state of the checkpoint at `folder`."""

    def train(
        self, samples: list[ScoredRollout], version: int, lineage: Lineage, max_staleness: int
    ) -> StepStats:
        """One optimizer step on whole groups (libs.trainer.step.train_step); the turns
        trained are those within `max_staleness` (the bound now: the pacer moves it) across
        `lineage`'s resumes."""

    def train_online(
        self, samples: list[OnlineSample], baselines: OnlineBaselines, version: int
    ) -> OnlineStepStats:
        """One optimizer step on online samples (libs.trainer.online_step)."""

    def failing_samples(self, samples: list[ScoredRollout]) -> list[tuple[ScoredRollout, str]]:
        """The samples that make a step fail on their own, with why ([]: none can be told)."""

    def published_state(self) -> dict[str, torch.Tensor]:
        """A copy of the weights as workers run them, owned by the caller."""

    def model_for_eval(self) -> PreTrainedModel:
        """The weights held, as a model the eval gate can generate with."""

    def write_tensors(self, folder: Path) -> None:
        """The checkpoint's weights and optimizer state, into `folder`, in line."""

    def snapshot_tensors(self, host: HostCopy) -> Callable[[Path], None] | None:
        """A writer of a host copy (in `host`'s buffers) of the tensors as they are now,
        which may run while training goes on; None when they can only be written in line."""

    def close(self) -> None:
        """Release what the learner holds beyond this process (the other ranks)."""

    def health_fields(self) -> dict[str, Any]: ...


class LocalLearner:
    """The whole policy and its AdamW state in this process (1 rank)."""

    def __init__(self, config: TrainerConfig, policy: PolicyConfig, tokenizer: Tokenizer) -> None:
        self.precision = TrainingPrecision.for_policy(config.master_weights, policy)
        self.policy = policy
        self.pad_id = tokenizer.pad_id
        self.model = self.precision.build_model(policy)
        check_vocabulary(self.model, tokenizer, policy)
        self.config = config.sized_for(sum(p.numel() for p in self.model.parameters()))
        self.optimizer = self._optimizer(learning_rate_at(self.config, 0))
        # The configured policy, never a checkpoint: a resumed run keeps its anchor.
        self._reference = setup_reference(self.config.kl_coef, policy)
        # The weights of the last versions, to score each token under its own (None: off).
        self._exact = setup_exact_mismatch(self.config)

    def _optimizer(self, learning_rate: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.model.parameters(), lr=learning_rate, weight_decay=self.config.weight_decay
        )

    def load(self, folder: Path) -> None:
        self.model = self.precision.build_model(
            self.policy.model_copy(update={"path": str(folder)})
        )
        self.optimizer = self._optimizer(learning_rate_of(self.optimizer))
        device = next(self.model.parameters()).device
        self.optimizer.load_state_dict(load_optimizer_state(folder, device))

    def train(
        self, samples: list[ScoredRollout], version: int, lineage: Lineage, max_staleness: int
    ) -> StepStats:
        trainable = turn_trainable(version, max_staleness, lineage.equivalent)
        if self._exact is not None:
            self._exact.keep(version, self.model)  # the weights of `version`, before the step
        stats = self._computing(
            train_step,
            self.model,
            self.optimizer,
            samples,
            version,
            self.config,
            self.pad_id,
            self._reference,
            trainable,
            equivalent=lineage.equivalent,
        )
        if self._exact is None or not self._exact.due():
            return stats
        measure = self._exact.measure
        exact = self._computing(
            measure, self.model, samples, version, self.config, self.pad_id, lineage.equivalent
        )
        return replace(stats, mismatch_exact=exact)

    def train_online(
        self, samples: list[OnlineSample], baselines: OnlineBaselines, version: int
    ) -> OnlineStepStats:
        if self._exact is not None:  # a version offline samples may come from
            self._exact.keep(version, self.model)
        return self._computing(
            train_online_step,
            self.model,
            self.optimizer,
            samples,
            baselines,
            version,
            self.config,
            self.config.online,
            self.pad_id,
        )

    def failing_samples(self, samples: list[ScoredRollout]) -> list[tuple[ScoredRollout, str]]:
        max_length = self.config.max_sequence_tokens
        return self._computing(
            find_failing_samples, self.model, samples, pad_id=self.pad_id, max_length=max_length
        )

    def _computing(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`function` in the trainer's compute precision (in the calling thread)."""
        with self.precision.compute():
            return function(*args, **kwargs)

    def published_state(self) -> dict[str, torch.Tensor]:
        return self.precision.published_copy(self.model)

    def model_for_eval(self) -> PreTrainedModel:
        return self.model

    def write_tensors(self, folder: Path) -> None:
        write_model_and_optimizer(self.model, self.optimizer, folder)

    def snapshot_tensors(self, host: HostCopy) -> Callable[[Path], None] | None:
        return host_snapshot_writer(self.model, self.optimizer, host)

    def close(self) -> None:
        return None

    def health_fields(self) -> dict[str, Any]:
        return {}


def setup_learner(config: TrainerConfig, policy: PolicyConfig, tokenizer: Tokenizer) -> Learner:
    """The learner this process's job asks for: N ranks under torchrun, else one."""
    if world_size() > 1:
        return RankLearner(config, policy, tokenizer)
    return LocalLearner(config, policy, tokenizer)
