"""The trainer as N processes (ranks) of one torch.distributed job: the policy replicated on
every rank when it fits one card, FSDP2-sharded when not (libs.trainer.sharded.place_policy).

    torchrun --standalone --nproc-per-node 2 -m services.trainer    # gloo on CPU, NCCL on GPU

Rank 0 is the trainer service (the loop of libs.trainer.loop with a `RankLearner`): it alone
connects to the bus, reads the scored stream, forms the batches (groups, staleness, the
exactly-once cursor), serves /healthz and /metrics, writes the step records, stages weights
for the broadcaster and writes checkpoints. The other ranks (`follow`) have no bus
connection. Everything done to the sharded model is a `Command` that rank 0 broadcasts on
the command channel and then runs itself; the other ranks receive each one and run it too,
so every rank enters every collective in the same order:

    Setup   the resolved config (learning rate and staleness bound sized on rank 0)
    Step    the batch's samples and learning rate -> the ranks' optimizer step
    Gather  the full weights on rank 0: the version to stage, once per version
    Save    each rank its shard in sharded/ (replicas: one copy over the ranks' files),
            the HF folder by rank 0
    Load    each rank its shard (or replica) of a sharded checkpoint
    Stop    the other ranks exit 0

Exactly-once is the 1-rank trainer's: a step's samples are marked consumed once every rank
has stepped on them, and the cursor, lineage and groups taken are written with the sharded
checkpoint (`state.json` beside `sharded/`, libs.trainer.checkpoint), so a resumed run
neither loses nor repeats samples.

A rank's death ends the job: the others' next collective fails (gloo: "Connection closed by
peer"), and torchrun stops every rank once one exits non-zero. The other ranks wait for rank
0's next command without a time limit (rank 0 may wait long for rollouts); the step's own
collectives keep the backend's timeout. SIGTERM/SIGINT, which torchrun passes to every rank,
drains rank 0: it finishes its step, checkpoints with the others and stops them; the other
ranks only log the signal (torchrun SIGKILLs a rank still alive 30 s after its SIGTERM).

Not supported with N ranks (refused at start, naming the setting): online training,
`kl_coef > 0`, `mismatch_exact_every_steps > 0` (unset: off here; libs.trainer.version_ring).
A step that fails is not retried without the samples to blame (the 1-rank
trainer's isolation): the job ends and resumes from its last checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from libs.logs import configure_logging
from libs.policy import PolicyConfig, build_policy, check_vocabulary, resolve_device
from libs.process_lifetime import die_with_parent
from libs.rl import turn_trainable
from libs.rl.online import OnlineBaselines
from libs.tokenizer import Tokenizer
from libs.trainer.checkpoint import SHARDED_DIR, is_sharded
from libs.trainer.config import TrainerConfig
from libs.trainer.host_memory import HostCopy
from libs.trainer.lineage import Lineage
from libs.trainer.online_step import OnlineStepStats
from libs.trainer.precision import TrainingPrecision
from libs.trainer.schedule import learning_rate_at, learning_rate_of, set_learning_rate
from libs.trainer.sharded import (
    export_policy_folder,
    full_state_dict,
    leave_process_group,
    load_sharded_checkpoint,
    place_policy,
    save_sharded_checkpoint,
    setup_process_group,
    sharded_train_step,
)
from libs.trainer.step import StepStats
from proto.messages import OnlineSample, ScoredRollout

log = structlog.get_logger(__name__)

# How long the other ranks wait for rank 0's next command: without limit, in effect.
COMMAND_WAIT = timedelta(days=365)


def weights_fingerprint(model: torch.nn.Module) -> float:
    """A number that differs when two unsharded models' weights differ (sums in float64)."""
    with torch.no_grad():
        return sum(
            float(p.double().sum()) + float(p.double().square().sum()) for p in model.parameters()
        )


def world_size() -> int:
    """Ranks of the trainer job (torchrun's WORLD_SIZE; 1 when started alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def this_rank() -> int:
    """This process's rank (torchrun's RANK; 0 when started alone)."""
    return int(os.environ.get("RANK", "0"))


def die_with_launcher() -> None:
    """Linux: SIGKILL this rank when the torchrun agent that started it dies, however it dies
    (a Ray actor's or the demo launcher's SIGKILL reaches the agent only), so no rank of a
    dead job is left waiting for the others."""
    die_with_parent(signal.SIGKILL)


def refuse_unsupported(config: TrainerConfig) -> None:
    """ValueError naming each setting the sharded trainer cannot run with."""
    problems = []
    if config.online.fraction > 0:
        problems.append("online training (set RLPIPE_TRAINER_ONLINE_FRACTION=0)")
    if config.kl_coef > 0:
        problems.append("a KL anchor (set RLPIPE_TRAINER_KL_COEF=0)")
    if config.mismatch_exact_every_steps:  # unset: off with N ranks
        problems.append(
            "the exact-version mismatch (set RLPIPE_TRAINER_MISMATCH_EXACT_EVERY_STEPS=0)"
        )
    if problems:
        raise ValueError(
            f"the sharded trainer ({world_size()} ranks) does not support "
            f"{' or '.join(problems)} yet; or run one rank (python -m services.trainer)"
        )


@dataclass
class RankModel:
    """What every rank holds: its shard of the policy and of the AdamW state."""

    config: TrainerConfig
    policy: PolicyConfig
    precision: TrainingPrecision
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    pad_id: int


class Command:
    """One operation on the sharded model that every rank runs (`run`), in the same order."""

    def run(self, ranks: RankModel) -> Any:
        raise NotImplementedError


@dataclass
class Setup(Command):
    """The trainer's resolved config: the other ranks build their shard of the model from it.
    Every rank builds the whole policy (seeded init, or the same folder) before sharding it;
    `fingerprint` is rank 0's, so a rank that built other weights stops instead of training
    a model made of mismatched shards."""

    config: TrainerConfig
    policy: PolicyConfig
    pad_id: int
    fingerprint: float

    def build(self) -> RankModel:
        precision = TrainingPrecision.for_policy(self.config.master_weights, self.policy)
        model = precision.build_model(self.policy)
        ours = weights_fingerprint(model)
        if not math.isclose(ours, self.fingerprint, rel_tol=1e-9):
            raise RuntimeError(
                f"rank {this_rank()} built other initial weights than rank 0 (fingerprint "
                f"{ours!r} vs {self.fingerprint!r}): every rank must load the same policy "
                "(RLPIPE_TRAINER_POLICY_PATH readable by each, or the same preset and seed)"
            )
        model, _ = place_policy(model, self.config)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=learning_rate_at(self.config, 0),
            weight_decay=self.config.weight_decay,
        )
        return RankModel(self.config, self.policy, precision, model, optimizer, self.pad_id)


@dataclass
class Step(Command):
    """One optimizer step on a batch's samples (libs.trainer.sharded.sharded_train_step)."""

    samples: list[ScoredRollout]
    version: int
    learning_rate: float
    lineage: Lineage
    max_staleness: int  # the bound now (rank 0's pacer moves it)

    def run(self, ranks: RankModel) -> StepStats:
        set_learning_rate(ranks.optimizer, self.learning_rate)
        trainable = turn_trainable(self.version, self.max_staleness, self.lineage.equivalent)
        with ranks.precision.compute():
            return sharded_train_step(
                ranks.model,
                ranks.optimizer,
                self.samples,
                self.version,
                ranks.config,
                ranks.pad_id,
                trainable,
                self.lineage.equivalent,
            )


@dataclass
class Gather(Command):
    """The full weights in `dtype` on rank 0's CPU (empty on the others)."""

    dtype: torch.dtype

    def run(self, ranks: RankModel) -> dict[str, torch.Tensor]:
        return full_state_dict(ranks.model, self.dtype)


@dataclass
class Save(Command):
    """A checkpoint's tensors into `folder`: every rank's shard of the weights and AdamW state
    in `sharded/`, the consolidated weights as the folder's HF model by rank 0."""

    folder: Path

    def run(self, ranks: RankModel) -> None:
        save_sharded_checkpoint(ranks.model, ranks.optimizer, self.folder / SHARDED_DIR)
        export_policy_folder(ranks.model, ranks.policy, self.folder)


@dataclass
class Load(Command):
    """Every rank's shard of the weights and AdamW state from a checkpoint folder."""

    folder: Path

    def run(self, ranks: RankModel) -> None:
        load_sharded_checkpoint(ranks.model, ranks.optimizer, self.folder / SHARDED_DIR)


@dataclass
class Stop(Command):
    """The other ranks leave their loop and exit."""

    def run(self, ranks: RankModel) -> None:
        return None


class CommandChannel:
    """Rank 0's commands to the other ranks: a gloo group of its own (objects travel on the
    CPU whatever the backend), waiting without limit. Collective to create: every rank
    creates it right after joining the process group."""

    def __init__(self) -> None:
        self._group = dist.new_group(backend="gloo", timeout=COMMAND_WAIT)

    def send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self._group)

    def receive(self) -> Command:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        command = box[0]
        assert isinstance(command, Command), f"rank 0 sent {type(command).__name__}"
        return command


class RankGroup:
    """Rank 0's side: each command sent to the other ranks, then run here."""

    def __init__(self, channel: CommandChannel, ranks: RankModel) -> None:
        self._channel = channel
        self.ranks = ranks

    def run(self, command: Command) -> Any:
        try:
            self._channel.send(command)
            return command.run(self.ranks)
        except RuntimeError as exc:
            raise RuntimeError(
                f"rank 0 failed running {type(command).__name__} with the other "
                f"{world_size() - 1} trainer rank(s): {exc}. When a peer closed its "
                "connection, another rank died: its log says why"
            ) from exc


class RankLearner:
    """Rank 0's learner (libs.trainer.learner): its shard of the policy, each operation run
    by every rank of the job through the command channel."""

    def __init__(self, config: TrainerConfig, policy: PolicyConfig, tokenizer: Tokenizer) -> None:
        refuse_unsupported(config)
        self.precision = TrainingPrecision.for_policy(config.master_weights, policy)
        self.policy = policy
        setup_process_group(self.precision.device)
        channel = CommandChannel()  # collective: right after joining, as every rank does
        model = self.precision.build_model(policy)
        fingerprint = weights_fingerprint(model)
        self.model, layout = place_policy(model, config)
        check_vocabulary(self.model, tokenizer, policy)
        self.config = config.sized_for(sum(p.numel() for p in self.model.parameters()))
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate_at(self.config, 0),
            weight_decay=self.config.weight_decay,
        )
        ranks = RankModel(
            self.config, policy, self.precision, self.model, self.optimizer, tokenizer.pad_id
        )
        self._ranks = RankGroup(channel, ranks)
        channel.send(Setup(self.config, policy, tokenizer.pad_id, fingerprint))
        log.info(
            "sharded trainer",
            ranks=world_size(),
            backend=dist.get_backend(),
            layout=layout,
        )

    def load(self, folder: Path) -> None:
        if not is_sharded(folder):
            raise ValueError(
                f"{folder} was written by a 1-rank trainer (no {SHARDED_DIR}/): resume it with "
                "one rank (python -m services.trainer), or start the sharded trainer from its "
                f"weights with RLPIPE_TRAINER_POLICY_PATH={folder} in a new run folder"
            )
        self._ranks.run(Load(folder))

    def train(
        self, samples: list[ScoredRollout], version: int, lineage: Lineage, max_staleness: int
    ) -> StepStats:
        learning_rate = learning_rate_of(self.optimizer)
        step = Step(samples, version, learning_rate, lineage, max_staleness)
        stats: StepStats = self._ranks.run(step)
        return stats

    def train_online(
        self, samples: list[OnlineSample], baselines: OnlineBaselines, version: int
    ) -> OnlineStepStats:
        raise AssertionError("online training is refused at start (refuse_unsupported)")

    def failing_samples(self, samples: list[ScoredRollout]) -> list[tuple[ScoredRollout, str]]:
        """None told: a step of N ranks is not retried without samples (the job ends and
        resumes from its last checkpoint)."""
        return []

    def published_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self._ranks.run(Gather(self.precision.compute_dtype))
        return state

    def model_for_eval(self) -> PreTrainedModel:
        """An unsharded copy in the policy's dtype on rank 0's device."""
        return _policy_with(self.policy, self.published_state())

    def write_tensors(self, folder: Path) -> None:
        self._ranks.run(Save(folder))

    def snapshot_tensors(self, host: HostCopy) -> Callable[[Path], None] | None:
        """None: a save is a collective of every rank (Save), written in line."""
        return None

    def close(self) -> None:
        """Stop the other ranks, then leave the process group with them."""
        self._ranks.run(Stop())
        leave_process_group()

    def health_fields(self) -> dict[str, Any]:
        return {"ranks": world_size()}


def _policy_with(policy: PolicyConfig, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    model = build_policy(policy)
    model.load_state_dict(state)
    return model


def follow(policy: PolicyConfig, log_level: str, log_format: str) -> None:
    """The body of ranks 1..N-1: join the job, build this rank's shard from rank 0's Setup,
    then run rank 0's commands until it says Stop."""
    rank = this_rank()
    configure_logging(f"trainer-rank{rank}", log_level, log_format)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _log_signal)
    setup_process_group(resolve_device(policy.device))
    channel = CommandChannel()
    setup = channel.receive()
    assert isinstance(setup, Setup), f"rank 0 began with {type(setup).__name__}"
    ranks = setup.build()
    log.info("following rank 0", rank=rank, ranks=world_size(), backend=dist.get_backend())
    try:
        while not isinstance(command := channel.receive(), Stop):
            command.run(ranks)
    except RuntimeError as exc:
        log.error("the trainer job broke: a rank died (its log says why)", error=str(exc))
        raise
    log.info("rank 0 stopped the job", rank=rank)
    leave_process_group()


def _log_signal(signum: int, frame: object) -> None:
    log.info("signal ignored: rank 0 drains and then stops this rank", signal=signum)
