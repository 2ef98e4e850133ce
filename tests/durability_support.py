"""Writers that tests/test_durability.py kills right after they announce what they wrote.

    python -m tests.durability_support stage <staging_dir> <nats_url> [count]
    python -m tests.durability_support checkpoint <checkpoint_dir> [count]

`stage` stages version 1 whole (stage_weights) and every later version as a delta on the
one before (write_staged_delta + announce_staged_delta), as a trainer on a GPU does; the
announcement is the `WeightsStaged` message on the bus. `checkpoint` takes an optimizer
step of the tiny policy, prints the weights' hash, and saves a checkpoint through the
trainer's own Checkpointer (in the background, as the trainer does); the announcement is its
"checkpoint saved" log line. Both go on until `count` versions or steps (0: until killed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

import torch

from libs.bus.connection import connect_bus
from libs.bus.publisher import Publisher
from libs.logs import configure_logging
from libs.policy import PolicyConfig
from libs.tokenizer import ByteTokenizer
from libs.trainer.checkpoint import TrainerState
from libs.trainer.checkpointer import Checkpointer
from libs.trainer.config import TrainerConfig
from libs.trainer.learner import LocalLearner
from libs.weights.encoder import encode
from libs.weights.handoff import announce_staged_delta, stage_weights, write_staged_delta
from libs.weights.hashing import state_hash
from libs.weights.tensors import raw_state

NUM_VALUES = 1 << 20  # 2 MB of bf16 a version


def weights(version: int) -> dict[str, torch.Tensor]:
    """The weights of `version`: the same for every process that asks."""
    master = torch.randn(NUM_VALUES, generator=torch.Generator().manual_seed(0)) * 0.02
    moved = torch.randn(NUM_VALUES, generator=torch.Generator().manual_seed(version))
    return {"w": (master + moved.sign() * 3e-6 * version).to(torch.bfloat16)}


async def stage_versions(staging_dir: Path, nats_url: str, count: int) -> None:
    bus = await connect_bus(nats_url, name="durability-stager")
    publisher = Publisher(bus.js)
    state = weights(1)
    await stage_weights(publisher, staging_dir, state, 1)
    for version in range(2, count + 1) if count else itertools.count(2):
        new = weights(version)
        manifest, chunks = encode(state, new, base_version=version - 1, version=version)
        write_staged_delta(staging_dir, manifest, chunks)
        await announce_staged_delta(publisher, staging_dir, version, version - 1)
        state = new
    await bus.nc.close()


def weights_hash(model: torch.nn.Module) -> str:
    return state_hash(raw_state(model.state_dict()))


def checkpoint_learner() -> tuple[LocalLearner, TrainerConfig]:
    config = TrainerConfig(checkpoint_in_background=True, checkpoint_keep=2)
    return LocalLearner(config, PolicyConfig(device="cpu", seed=0), ByteTokenizer()), config


async def save_checkpoints(checkpoint_dir: Path, count: int) -> None:
    learner, config = checkpoint_learner()
    checkpointer = Checkpointer(checkpoint_dir, learner, ByteTokenizer(), config)
    for step in range(1, count + 1) if count else itertools.count(1):
        _optimizer_step(learner)
        print(json.dumps({"step": step, "weights_hash": weights_hash(learner.model)}), flush=True)
        await checkpointer.save(TrainerState(step=step, version=step), set())
    await checkpointer.written()


def _optimizer_step(learner: LocalLearner) -> None:
    """A step that moves every weight and fills AdamW's state."""
    learner.optimizer.zero_grad()
    loss = sum((p.float() ** 2).sum() for p in learner.model.parameters())
    loss.backward()  # type: ignore[union-attr]
    learner.optimizer.step()


def main(argv: list[str]) -> None:
    configure_logging("durability-writer", fmt="json")
    kind, folder, *rest = argv
    if kind == "stage":
        count = int(rest[1]) if len(rest) > 1 else 0
        asyncio.run(stage_versions(Path(folder), rest[0], count))
    else:
        asyncio.run(save_checkpoints(Path(folder), int(rest[0]) if rest else 0))


if __name__ == "__main__":
    main(sys.argv[1:])
