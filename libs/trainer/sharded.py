"""The trainer's optimizer step over N ranks: the policy replicated on each rank, or each
rank holding 1/N of the weights, gradients and AdamW state (PyTorch FSDP2); the batch rows
are split across ranks either way.

    setup_process_group(device)                    # gloo on CPU, NCCL on GPU
    model, layout = place_policy(build_policy(policy), trainer_config)  # replicas or shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=...)
    stats = sharded_train_step(model, optimizer, samples, version, step_config, pad_id)
    save_sharded_checkpoint(model, optimizer, folder)   # torch.distributed.checkpoint
    load_sharded_checkpoint(model, optimizer, folder)
    state = full_state_dict(model, torch.bfloat16)      # rank 0: the weights to stage
    export_policy_folder(model, policy, folder)         # rank 0: an HF folder (save_policy)

The step is the 1-rank step itself (`libs.trainer.step.train_step` and `optimize_on_batch`,
one code path) told by `RankShare` which rows are this rank's and how figures join:
- rows: each minibatch of the 1-rank step (the same contiguous slices) is split across the
  ranks; a rank without rows in a minibatch runs one masked row (no loss tokens), since every
  rank must enter every forward, backward and gradient sum.
- normalization: the 1-rank loss is a token mean over the minibatch. Each rank divides its
  token sum by the minibatch's global token count (`num_tokens_total`) and the gradients are
  summed over the ranks (FSDP2's reduction with divide factor 1; replicas: `ReplicaShare`'s
  all-reduce), so the summed gradient is the 1-rank gradient, whatever the ranks' shares.
- clipping: `clip_grad_norm_` on the summed gradients (DTensors when sharded) computes the
  global norm.
The loss and statistics reported are the global ones (a sum over ranks; the mismatch over
the whole batch, from the gathered proximal logprobs).

The trainer service runs it as N processes (libs.trainer.ranks: rank 0 reads the stream and
drives the others). Not there: reference-policy KL (`kl_coef > 0` is refused); FSDP2's
mixed-precision policy (the step runs under `TrainingPrecision.compute()` as the 1-rank
loop's does). Tested on gloo (CPU) and on NCCL with 2 GPUs (tests/test_sharded_trainer.py).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from transformers import PreTrainedModel

from libs.policy import (
    PolicyConfig,
    build_policy,
    parameter_bytes,
    resolve_device,
    resolve_dtype,
    save_policy,
)
from libs.rl import PolicyLossStats
from libs.trainer.config import TrainerConfig
from libs.trainer.step import (
    RowShare,
    StepConfig,
    StepStats,
    merge_loss_stats,
    minibatch_slices,
    train_step,
)
from proto.messages import ScoredRollout

NO_NVLINK_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def setup_process_group(device: torch.device) -> None:
    """Join the job's process group (torchrun's env:// variables): NCCL on GPU, gloo on CPU.
    On GPU each rank takes the card of its LOCAL_RANK, so `device="cuda"` means that card.
    NVLink multicast stays off unless the environment says otherwise: the ranks' collectives
    are a model's worth of bytes on one host, where it gains little, and on hosts whose
    GPUs others share a program that uses it can take them out of service."""
    for name, value in NO_NVLINK_MULTICAST.items():
        os.environ.setdefault(name, value)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def leave_process_group() -> None:
    """Leave the job's process group once every rank got here (a rank that tears its group
    down while another still finishes its last collective can abort that one). End the
    process with `exit_rank` afterwards."""
    dist.barrier()
    dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process after `leave_process_group`, without the interpreter's teardown.

    `destroy_process_group` drops Python's references only: C++ still holds the gloo group
    (checked: a weak reference to it outlives the model and a gc), so its worker threads
    outlive `main`. A worker that releases a tensor while the interpreter finalizes takes
    the GIL, and a thread that takes it then is unwound, which aborts the process ("terminate
    called without an active exception", SIGABRT: rank 1 of the 2-rank test, in make test
    once before that barrier was added and once after; pytorch issue 190489). The rank's
    files are closed by now; stdio is flushed here."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def shard_policy(model: PreTrainedModel, reshard_after_forward: bool = True) -> PreTrainedModel:
    """`model` sharded in place by FSDP2: one unit per decoder layer, the rest (embeddings,
    tied head, final norm) in the root unit; gradients summed, not averaged, across ranks.
    `reshard_after_forward` False keeps each layer's gathered weights from its forward to its
    backward: one all-gather per layer and step instead of two, at the memory of the whole
    model gathered (`keeps_gathered_weights` says when that is cheap)."""
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Plain SUM collectives with no division (gloo has no AVG or PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


# Replicas: weights, gradients and AdamW's two moments (4x the weights in their training
# dtype, plus the flat buffer the gradients are summed in) in at most this fraction of one
# card. byte-0.5b: 2 GB of fp32 weights, ~10 GB of an H200's 141; byte-3b's ~60 GB shard.
REPLICATE_FRACTION = 0.25


def place_policy(model: PreTrainedModel, config: TrainerConfig) -> tuple[PreTrainedModel, str]:
    """`model` laid out over the ranks as `config.rank_layout` says, and the layout's name.
    Replicated, each rank steps the whole model on its share of the rows and the gradients
    are summed in one all-reduce: a model that fits one card trains without FSDP2's
    per-layer gathers and its per-tensor host-side work, which on 2 H200s left the GPUs idle
    a quarter of a byte-0.5b step (0.37 s a step against 0.27 s of GPU work). Sharded, each
    rank holds 1/N of everything (FSDP2), for models that do not fit."""
    if replicates(model, config.rank_layout):
        return model, "replicated"
    keep = keeps_gathered_weights(model, config.rank_reshard_after_forward)
    name = "sharded, weights kept gathered to the backward" if keep else "sharded"
    return shard_policy(model, reshard_after_forward=not keep), name


def replicates(model: PreTrainedModel, layout: str) -> bool:
    """Whether the ranks hold replicas: `layout` "replicate" or "shard", or ("auto") whether
    the training state fits REPLICATE_FRACTION of one card. On a CPU, auto shards: the
    ranks' processes share the host's memory, which replicas would multiply."""
    if layout != "auto":
        return layout == "replicate"
    return _fits_card(model, 5 * parameter_bytes(model), REPLICATE_FRACTION, on_cpu=False)


# A model whose weights (in their training dtype) take at most this fraction of one card's
# memory keeps them gathered from forward to backward: byte-0.5b's fp32 masters are 2 GB of
# an H200's 141; qwen2-7b's 30 GB stay sharded.
KEEP_GATHERED_FRACTION = 0.25


def keeps_gathered_weights(model: PreTrainedModel, override: bool | None) -> bool:
    """Whether the ranks keep each layer's gathered weights to its backward (not resharding
    after forward): `override` when given, else whether the whole model in its training dtype
    fits KEEP_GATHERED_FRACTION of one card (always on a CPU: host memory)."""
    if override is not None:
        return not override
    return _fits_card(model, parameter_bytes(model), KEEP_GATHERED_FRACTION, on_cpu=True)


def _fits_card(model: PreTrainedModel, size: int, fraction: float, on_cpu: bool) -> bool:
    """Whether `size` bytes fit `fraction` of the memory of `model`'s card (`on_cpu` for a
    model on the CPU)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return on_cpu
    return size <= fraction * torch.cuda.get_device_properties(device).total_memory


def sharded_train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    samples: list[ScoredRollout],
    trainer_version: int,
    config: StepConfig,
    pad_id: int,
    trainable: Callable[[int], bool] | None = None,
    equivalent: Callable[[int], int] | None = None,
) -> StepStats:
    """`libs.trainer.step.train_step` on a sharded `model`, this rank training its share of
    each minibatch; every rank passes the same `samples` and gets the same (global) statistics."""
    if config.kl_coef > 0:
        raise ValueError("kl_coef > 0 is not supported by the sharded trainer yet; set it to 0")
    return train_step(
        model,
        optimizer,
        samples,
        trainer_version,
        config,
        pad_id,
        trainable=trainable,
        share=RankShare() if isinstance(model, FSDPModule) else ReplicaShare(),
        equivalent=equivalent,
    )


def rank_rows(num_rows: int, minibatches: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows of each minibatch: the 1-rank step's slices
    (`libs.trainer.step.minibatch_slices`), each split in `world` contiguous parts (some
    may be empty)."""
    slices = minibatch_slices(num_rows, minibatches, torch.device("cpu"))
    return [rows.tensor_split(world)[rank] for rows in slices]


class RankShare(RowShare):
    """The rows and figures of this rank of the process group (`optimize_on_batch`)."""

    def minibatch_rows(
        self, num_rows: int, minibatches: int, device: torch.device
    ) -> list[torch.Tensor]:
        rows = rank_rows(num_rows, minibatches, dist.get_rank(), dist.get_world_size())
        return [part.to(device) for part in rows]

    def total(self, value: torch.Tensor) -> torch.Tensor:
        summed = value.clone()  # on the batch's device: NCCL reduces device tensors only
        dist.all_reduce(summed)
        return summed

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (rows.cpu(), local.cpu()))
        full = torch.zeros((num_rows, *local.shape[1:]), dtype=local.dtype)
        for part_rows, part in parts:
            full[part_rows] = part
        return full.to(local.device)

    def merge(self, stats: PolicyLossStats) -> PolicyLossStats:
        """Ranks without loss tokens in the minibatch are left out."""
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, stats)
        counted = [s for s in parts if s.num_tokens > 0]
        return merge_loss_stats(counted or parts[:1])


class ReplicaShare(RankShare):
    """RankShare for replicas: the gradients are summed here, in one all-reduce of a flat
    buffer (FSDP2 reduces a sharded model's during its backward)."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        assert len({g.dtype for g in grads}) == 1, "replicas sum gradients of one dtype"
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            # Views of the summed buffer: no copy back; the next zero_grad drops them.
            param.grad = flat[offset : offset + grad.numel()].view_as(grad)
            offset += grad.numel()


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
    """The full weights in `dtype` on rank 0, on the ranks' device (empty elsewhere);
    collective: every rank calls it. What the weight stager publishes, gathered once per
    version: each rank casts its shards into one flat buffer on the device and a single
    all-gather joins them, so the version costs one collective of the model's bytes in
    `dtype`. Per-tensor gathers of the fp32 state (torch's get_model_state_dict, ~290
    collectives for byte-0.5b) took 0.17 s a version on 2 H200s. Every rank receives the
    whole flat copy (the model's bytes in `dtype`, transiently). Replicas: rank 0's own
    weights, cast (copied) there, with no collective."""
    if not isinstance(model, FSDPModule):
        if not _is_rank0():
            return {}
        return {n: t.detach().to(dtype, copy=True) for n, t in model.state_dict().items()}
    state = model.state_dict()
    world = dist.get_world_size()
    layout, flat = _flat_shards(state, dtype, world)
    gathered = torch.empty(world * flat.numel(), dtype=dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat)
    del flat
    if not _is_rank0():
        return {}
    by_rank = gathered.view(world, -1)
    full = {}
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            full[name] = tensor.detach().to(dtype, copy=True)  # the same on every rank
            continue
        offset, rows = layout[id(tensor)]
        row_shape = tensor.shape[1:]
        numel = rows * math.prod(row_shape)
        pieces = by_rank[:, offset : offset + numel].reshape(world * rows, *row_shape)
        full[name] = pieces[: tensor.shape[0]].clone()
    return full


def _flat_shards(
    state: dict[str, Any], dtype: torch.dtype, world: int
) -> tuple[dict[int, tuple[int, int]], torch.Tensor]:
    """This rank's dim-0 shards of the sharded tensors of `state` cast to `dtype` in one flat
    buffer, each padded to the largest rank's row count (FSDP2 shards like torch.chunk) so
    every rank's buffer has the same layout: {id(tensor): (offset, rows)} and the buffer."""
    layout: dict[int, tuple[int, int]] = {}
    shards: list[tuple[int, torch.Tensor]] = []
    total = 0
    for tensor in state.values():
        if not isinstance(tensor, DTensor) or id(tensor) in layout:  # tied: gathered once
            continue
        assert tensor.placements == (Shard(0),), f"not sharded on dim 0: {tensor.placements}"
        rows = -(-tensor.shape[0] // world)
        layout[id(tensor)] = (total, rows)
        shards.append((total, tensor.to_local()))
        total += rows * math.prod(tensor.shape[1:])
    device = shards[0][1].device if shards else torch.device("cpu")
    flat = torch.zeros(total, dtype=dtype, device=device)
    with torch.no_grad():
        for offset, local in shards:
            flat[offset : offset + local.numel()].copy_(local.reshape(-1))
    return layout, flat


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
