"""Trainer checkpoints: model, optimizer, and how far each input stream was consumed.

Layout: `<dir>/step-<N>/` with `config.json` + `model.safetensors` and the tokenizer's files
(a model folder: `policy_path` or `transformers` load it as is), `optimizer.pt`, and
`state.json` (step, version, cursors, online baselines). A checkpoint is written to a
temporary folder, made durable (every file and folder fsynced) and renamed into place
(libs.durable_files), so a crash mid-write, of the process or of the machine, leaves the
previous one intact; `latest_checkpoint` only ever sees complete folders.

A sharded trainer (libs.trainer.ranks, N ranks) writes the same folder with `sharded/` (each
rank's shard of the weights and AdamW state, torch.distributed.checkpoint) in place of
`optimizer.pt`; its `config.json` + `model.safetensors` are the consolidated weights, gathered
once, so it is a model folder as well. Resuming needs the kind of trainer that wrote it.

Every checkpoint is a model folder users can take away: `AutoModelForCausalLM` and
`AutoTokenizer.from_pretrained(folder)` load it, chat template included (the byte tokenizer
too, libs.tokenizer), and a worker serving it (`RLPIPE_ROLLOUT_WORKER_POLICY_PATH`, not
following the trainer) reports the version in its `state.json` (`checkpoint_version`).

The newest `keep` (`checkpoint_keep`) are kept, and so are the checkpoints of `protected`
versions whatever their age: the trainer protects the version serving (promoted by the eval
gate) and the best held-out score so far.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import PreTrainedModel

from libs.chat.template import save_tokenizer
from libs.durable_files import publish_durably
from libs.policy import save_policy
from libs.rl.online import OnlineBaselines
from libs.tokenizer import Tokenizer
from libs.trainer.cursor import ConsumedCursor
from libs.trainer.host_memory import HostCopy
from libs.trainer.lineage import Lineage

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
SHARDED_DIR = "sharded"


class TrainerState(msgspec.Struct, kw_only=True):
    """What besides tensors a resumed trainer needs."""

    step: int
    version: int
    # Incremented at each resume; step records carry it, so records of steps lost with a
    # crash (written after the last checkpoint) can be told from their replacements.
    segment: int = 0
    groups_taken: int = 0
    scored_cursor: ConsumedCursor = msgspec.field(default_factory=ConsumedCursor)
    # The online stream's cursor and the running reward baselines of online samples
    # (defaults: checkpoints written before online training load as "nothing consumed").
    online_cursor: ConsumedCursor = msgspec.field(default_factory=ConsumedCursor)
    online_baselines: OnlineBaselines = msgspec.field(default_factory=OnlineBaselines)
    # Group ids taken lately (bounded, oldest first): a copy of a sample of one of them read
    # after a resume is a duplicate, consumed without training (libs.trainer.groups).
    recent_groups: list[str] = msgspec.field(default_factory=list)
    # The latest resume, so staleness counts updates, not version numbers (libs.trainer.lineage).
    lineage: Lineage = msgspec.field(default_factory=Lineage)
    # The version with the best held-out score of the eval gate so far, and that score.
    best_eval_version: int | None = None
    best_eval_score: float | None = None

    def note_eval(self, version: int, score: float) -> bool:
        """Remember `version` if its held-out score is the best yet; True when it is."""
        if self.best_eval_score is not None and score <= self.best_eval_score:
            return False
        self.best_eval_version, self.best_eval_score = version, score
        return True


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: TrainerState


def save_checkpoint(
    directory: Path,
    state: TrainerState,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    tokenizer: Tokenizer,
    keep: int,
    protected: Collection[int] = (),
) -> Path:
    """Write a complete checkpoint of a 1-rank trainer for `state.step`; returns its folder,
    a model folder that transformers loads with its tokenizer. Then prune all but the newest
    `keep` and those of the `protected` versions."""
    write_tensors = partial(write_model_and_optimizer, model, optimizer)
    return write_checkpoint(directory, state, write_tensors, tokenizer, keep, protected)


def write_model_and_optimizer(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, folder: Path
) -> None:
    """A 1-rank trainer's tensors: the model folder's weights and `optimizer.pt`."""
    save_policy(model, folder)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)


def host_snapshot_writer(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, host: HostCopy
) -> Callable[[Path], None]:
    """A copy in `host`'s buffers of `model`'s weights and `optimizer`'s state as they are
    now, and a writer of that copy (the files of `write_model_and_optimizer`) that may run
    while training goes on. Tensors sharing storage (tied embeddings) stay shared in the
    copy, so the model folder is the one `save_policy` writes."""
    copies: dict[tuple[int, torch.device], torch.Tensor] = {}
    weights = {}
    for name, tensor in model.state_dict().items():
        shared = (tensor.data_ptr(), tensor.device)
        if shared not in copies:
            copies[shared] = host.copy(f"weights/{name}", tensor)
        weights[name] = copies[shared]
    keys = iter(range(1 << 62))
    optimizer_state = _map_tensors(
        optimizer.state_dict(), lambda t: host.copy(f"optimizer/{next(keys)}", t)
    )

    def write(folder: Path) -> None:
        model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
        torch.save(optimizer_state, folder / OPTIMIZER_FILE)

    return write


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` (nested dicts, lists, tuples) with every tensor replaced by `fn(tensor)` and
    everything else copied (an optimizer's param groups change with the schedule)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def write_checkpoint(
    directory: Path,
    state: TrainerState,
    write_tensors: Callable[[Path], None],
    tokenizer: Tokenizer,
    keep: int,
    protected: Collection[int] = (),
) -> Path:
    """`save_checkpoint` with the weights and optimizer state written by `write_tensors`
    into the (temporary) folder it is given: the model folder, state and pruning are the
    same for every kind of trainer."""
    final = directory / f"step-{state.step:08d}"
    partial = directory / f".step-{state.step:08d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_tensors(partial)
    save_tokenizer(tokenizer, partial)
    (partial / STATE_FILE).write_bytes(msgspec.json.encode(state))
    shutil.rmtree(final, ignore_errors=True)
    publish_durably(partial, final)
    _prune(directory, keep, set(protected))
    return final


def latest_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest complete checkpoint in `directory`, or None."""
    if not directory.exists():
        return None
    for path in sorted(directory.glob("step-*"), reverse=True):
        state_file = path / STATE_FILE
        if state_file.exists():
            return Checkpoint(path, msgspec.json.decode(state_file.read_bytes(), type=TrainerState))
    return None


def load_optimizer_state(checkpoint_dir: Path, device: torch.device) -> dict[str, Any]:
    """The optimizer state saved in `checkpoint_dir`, with its tensors on `device`."""
    if not (checkpoint_dir / OPTIMIZER_FILE).exists() and is_sharded(checkpoint_dir):
        raise ValueError(
            f"{checkpoint_dir} was written by a sharded trainer (its AdamW state is in "
            f"{SHARDED_DIR}/): resume it with the sharded trainer (torchrun --nproc-per-node N "
            "-m services.trainer), or start a 1-rank run from its weights with "
            f"RLPIPE_TRAINER_POLICY_PATH={checkpoint_dir} in a new run folder"
        )
    state: dict[str, Any] = torch.load(
        checkpoint_dir / OPTIMIZER_FILE, map_location=device, weights_only=True
    )
    return state


def is_sharded(checkpoint_dir: Path) -> bool:
    """True for a checkpoint written by a sharded trainer."""
    return (checkpoint_dir / SHARDED_DIR).is_dir()


def checkpoint_version(folder: str | Path | None) -> int | None:
    """The policy version of the checkpoint at `folder`, None when it is not one of ours."""
    if folder is None:
        return None
    try:
        state = msgspec.json.decode((Path(folder) / STATE_FILE).read_bytes(), type=TrainerState)
    except (OSError, msgspec.DecodeError):
        return None
    return state.version


def _prune(directory: Path, keep: int, protected: set[int]) -> None:
    for path in sorted(directory.glob("step-*"), reverse=True)[keep:]:
        if checkpoint_version(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
