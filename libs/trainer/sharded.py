"""The trainer's optimizer step over N ranks with PyTorch FSDP2: each rank holds 1/N of the
weights, gradients and AdamW state; the batch rows are split across ranks.

    setup_process_group(device)                    # gloo on CPU, NCCL on GPU
    model = shard_policy(build_policy(policy))     # fully_shard each decoder layer, then root
    optimizer = torch.optim.AdamW(model.parameters(), lr=...)
    stats = sharded_train_step(model, optimizer, samples, version, step_config, pad_id)
    save_sharded_checkpoint(model, optimizer, folder)   # torch.distributed.checkpoint
    load_sharded_checkpoint(model, optimizer, folder)
    state = full_state_dict(model, torch.bfloat16)      # rank 0: the weights to stage
    export_policy_folder(model, policy, folder)         # rank 0: an HF folder (save_policy)

The step is `libs.trainer.step.optimize_on_batch`'s recipe (proximal logprobs without grad,
then PPO-clip per minibatch, global-norm clipping, AdamW) with the same loss function
(`libs.rl.ppo_clip_loss`), made rank-aware in three places:
- rows: each minibatch of the 1-rank step (the same contiguous slices) is split across the
  ranks; a rank without rows in a minibatch runs one masked row (no loss tokens), since every
  rank must enter every forward and backward (FSDP2 gathers weights there).
- normalization: the 1-rank loss is a token mean over the minibatch. Each rank divides its
  token sum by the minibatch's global token count (`num_tokens_total`) and FSDP2's gradient
  reduction sums (divide factor 1) instead of averaging, so the reduced gradient is the
  1-rank gradient, whatever the ranks' token shares.
- clipping: `clip_grad_norm_` on the DTensor gradients computes the global norm.
The loss and statistics reported are the global ones (a sum over ranks; the mismatch over
the whole batch, from the gathered proximal logprobs).

How the trainer service would run it (NOT wired yet): `torchrun --nproc-per-node N -m
services.trainer` (or a Ray placement group of N actors) starts N processes; rank 0 alone
reads the scored stream, forms the batch and acks, and `broadcast_samples` hands the same
samples to every rank; every rank runs `sharded_train_step`; once per version every rank
calls `full_state_dict` (a collective) and rank 0 hands the result to the weight stager and
writes the lineage/cursor state next to the sharded checkpoint. What is not there: the
trainer loop (libs/trainer/loop.py) still runs one process and does not call this module;
no torchrun or Ray launch; no reference-policy KL (`kl_coef > 0` is refused); no FSDP2
mixed-precision policy (a caller may wrap the step in `TrainingPrecision.compute()` as the
loop does); the cursor/lineage are not in the sharded checkpoint. Only gloo on CPU has run
(tests/test_sharded_trainer.py); the NCCL path is written but untested.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from libs.policy import (
    PolicyConfig,
    build_policy,
    resolve_device,
    resolve_dtype,
    save_policy,
    sequence_logprobs,
)
from libs.rl import (
    PolicyLossStats,
    TrainBatch,
    mismatch_stats,
    ppo_clip_loss,
    same_version_mask,
)
from libs.trainer.step import StepConfig, StepStats, merge_loss_stats, prepare_batch
from proto.messages import ScoredRollout


def setup_process_group(device: torch.device) -> None:
    """Join the job's process group (torchrun's env:// variables): NCCL on GPU, gloo on CPU.
    On GPU each rank takes the card of its LOCAL_RANK, so `device="cuda"` means that card."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def shard_policy(model: PreTrainedModel) -> PreTrainedModel:
    """`model` sharded in place by FSDP2: one unit per decoder layer, the rest (embeddings,
    tied head, final norm) in the root unit; gradients summed, not averaged, across ranks."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Plain SUM collectives with no division (gloo has no AVG or PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def broadcast_samples(samples: list[ScoredRollout] | None) -> list[ScoredRollout]:
    """Rank 0's samples on every rank (rank 0 reads the stream; the others pass None)."""
    box: list[Any] = [samples if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])


def sharded_train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    samples: list[ScoredRollout],
    trainer_version: int,
    config: StepConfig,
    pad_id: int,
    trainable: Callable[[int], bool] | None = None,
) -> StepStats:
    """`libs.trainer.step.train_step` on a sharded `model`; every rank passes the same
    `samples` and gets the same (global) statistics."""
    if config.kl_coef > 0:
        raise ValueError("kl_coef > 0 is not supported by the sharded trainer yet; set it to 0")
    groups, batch = prepare_batch(model, samples, config, pad_id, trainable)
    loss, grad_norm, policy, proximal = _optimize_sharded(model, optimizer, batch, config)
    same_version = same_version_mask(batch.token_versions, trainer_version, batch.loss_mask)
    return StepStats(
        loss=loss,
        num_samples=len(samples),
        num_rows=batch.num_rows,
        num_loss_tokens=batch.num_loss_tokens,
        num_groups=groups.num_groups,
        num_zero_variance_groups=groups.num_zero_variance_groups,
        grad_norm=grad_norm,
        policy=policy,
        mismatch=mismatch_stats(proximal, batch.behavior_logprobs, same_version),
    )


def rank_rows(num_rows: int, minibatches: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows of each minibatch: the 1-rank step's slices
    (`optimize_on_batch`), each split in `world` contiguous parts (some may be empty)."""
    count = max(1, min(minibatches, num_rows))
    return [rows.tensor_split(world)[rank] for rows in torch.arange(num_rows).tensor_split(count)]


def _optimize_sharded(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: TrainBatch, config: StepConfig
) -> tuple[float, float, PolicyLossStats, torch.Tensor]:
    """Proximal logprobs, then one PPO-clip step per minibatch; (global loss mean, largest
    global pre-clip norm, merged loss stats, proximal logprobs of the whole batch)."""
    minibatches = rank_rows(
        batch.num_rows, config.minibatches, dist.get_rank(), dist.get_world_size()
    )
    model.eval()  # no dropout: proximal and new logprobs must come from the same function
    mine = torch.cat(minibatches).to(batch.input_ids.device)
    proximal = _gather_rows(_logprobs_no_grad(model, batch, mine), mine, batch)
    losses, stats, norms = [], [], []
    for rows in minibatches:
        loss, loss_stats = _rank_loss(model, batch, proximal, rows, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(
            _full(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        )
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        stats.append(_merge_over_ranks(loss_stats))
    return sum(losses) / len(losses), max(norms), merge_loss_stats(stats), proximal


def _rank_loss(
    model: PreTrainedModel,
    batch: TrainBatch,
    proximal: torch.Tensor,
    rows: torch.Tensor,
    config: StepConfig,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """This rank's share of one minibatch's loss: its token sum over the minibatch's global
    token count. No rows: one row with its mask cleared (zero loss and gradient)."""
    device = batch.input_ids.device  # NCCL reduces device tensors only
    tokens = torch.tensor(int(batch.loss_mask[rows].sum()), device=device)
    dist.all_reduce(tokens)
    loss_mask = batch.loss_mask[rows]
    if len(rows) == 0:
        rows = torch.zeros(1, dtype=torch.long)
        loss_mask = torch.zeros_like(batch.loss_mask[rows])
    rows = rows.to(device)
    new = sequence_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows])
    return ppo_clip_loss(
        new,
        proximal[rows],
        batch.behavior_logprobs[rows],
        batch.advantages[rows],
        loss_mask,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        is_cap=config.importance_weight_cap,
        num_tokens_total=int(tokens),
    )


def _logprobs_no_grad(
    model: PreTrainedModel, batch: TrainBatch, rows: torch.Tensor
) -> torch.Tensor:
    """Logprobs [len(rows), T-1] of `rows` (one masked-out row when empty: FSDP2 needs every
    rank in every forward)."""
    scored = rows if len(rows) > 0 else torch.zeros(1, dtype=torch.long, device=rows.device)
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch.input_ids[scored], batch.attention_mask[scored])
    return logprobs[: len(rows)]


def _gather_rows(local: torch.Tensor, rows: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """The whole batch's [B, T-1] tensor from each rank's `local` rows."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (rows.cpu(), local.cpu()))
    full = torch.zeros(batch.loss_mask.shape, dtype=local.dtype)
    for part_rows, part in parts:
        full[part_rows] = part
    return full.to(local.device)


def _merge_over_ranks(stats: PolicyLossStats) -> PolicyLossStats:
    """One minibatch's loss statistics over all ranks (ranks without loss tokens left out)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, stats)
    counted = [s for s in parts if s.num_tokens > 0]
    return merge_loss_stats(counted or parts[:1])


def _full(value: torch.Tensor) -> float:
    """A replicated or sharded scalar as a float (DTensor norms become full tensors)."""
    return float(value.full_tensor() if isinstance(value, DTensor) else value)


def save_sharded_checkpoint(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, folder: str | Path
) -> None:
    """Each rank writes its shard of the weights and AdamW state to `folder` (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def load_sharded_checkpoint(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, folder: str | Path
) -> None:
    """Restore `save_sharded_checkpoint`'s weights and AdamW state into a sharded `model` and
    its `optimizer` (collective). DCP can reshard to another world size; only the same size
    is tested (tests/test_sharded_trainer.py)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def full_state_dict(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full weights on CPU in `dtype` on rank 0 (empty elsewhere); collective: every
    rank calls it. What the weight stager publishes, gathered once per version."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    full = {}
    for name, tensor in state.items():
        assert isinstance(tensor, torch.Tensor), f"{name} is not a tensor in the state dict"
        full[name] = tensor.to(dtype)
    return full


def export_policy_folder(model: PreTrainedModel, policy: PolicyConfig, folder: str | Path) -> None:
    """Rank 0 writes the consolidated weights as an HF folder (`save_policy`), in the
    policy's dtype on its device's terms; collective: every rank calls it."""
    dtype = resolve_dtype(policy.dtype, resolve_device(policy.device))
    cpu_policy = policy.model_copy(
        update={"device": "cpu", "dtype": str(dtype).removeprefix("torch.")}
    )
    target = build_policy(cpu_policy) if _is_rank0() else None
    state = full_state_dict(model, dtype)
    if target is not None:
        target.load_state_dict(state)
        save_policy(target, folder)
    dist.barrier()


def _is_rank0() -> bool:
    return dist.get_rank() == 0
