"""The trainer's precision: the dtype its weights and AdamW state live in, the dtype it
computes in, and the dtype of the weights it publishes.

    precision = TrainingPrecision.for_policy("fp32", policy)   # bf16 policy on a GPU
    model = precision.build_model(policy)                      # fp32 master weights
    with precision.compute():                                  # bf16 matmuls (autocast)
        train_step(model, ...)
    state = precision.published_copy(model)                    # bf16, what workers run

Why fp32 master weights: AdamW moves each weight by about the learning rate per step. In
bf16 (8 significant bits) an update smaller than half a unit in the last place of the weight
is rounded away, so a bf16-only trainer either learns nothing at small learning rates or
needs rates large enough to wreck a random-init 0.5B model (byte-0.5b collapsed to reward
0 at 5e-4). With fp32 masters small steps accumulate, and a
published bf16 value changes only once its master has moved by half an ulp, so at small
rates most values stay put and the delta the weight codec ships is sparse. On CPU the
policy is fp32 already and both settings are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from libs.policy import PolicyConfig, build_policy, resolve_device, resolve_dtype

MasterWeights = Literal["fp32", "policy"]
"""fp32: fp32 weights and optimizer state, compute in the policy's dtype (mixed precision);
policy: weights, optimizer state and compute all in the policy's dtype."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class TrainingPrecision:
    """Which dtype the trainer keeps, computes in and publishes."""

    master_dtype: torch.dtype
    compute_dtype: torch.dtype  # the policy's dtype: what workers run and are sent
    device: torch.device

    @classmethod
    def for_policy(cls, master: MasterWeights, policy: PolicyConfig) -> TrainingPrecision:
        device = resolve_device(policy.device)
        compute = resolve_dtype(policy.dtype, device)
        return cls(torch.float32 if master == "fp32" else compute, compute, device)

    @property
    def mixed(self) -> bool:
        """True when the master weights are wider than the dtype computed in."""
        return self.master_dtype != self.compute_dtype

    def build_model(self, policy: PolicyConfig) -> PreTrainedModel:
        """The policy's model with its weights in the master dtype."""
        return build_policy(policy.model_copy(update={"dtype": _DTYPE_NAMES[self.master_dtype]}))

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Forward and backward passes in the compute dtype (autocast when mixed). Autocast
        state is per thread: enter it in the thread that runs the model."""
        context = (
            torch.autocast(self.device.type, dtype=self.compute_dtype)
            if self.mixed
            else nullcontext()
        )
        with context:
            yield

    def published_copy(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """A copy of the weights as workers run them (the compute dtype), on the model's
        device, owned by the caller: later optimizer steps do not change it."""
        with torch.no_grad():
            return {
                name: tensor.detach().to(self.compute_dtype, copy=True)
                for name, tensor in model.state_dict().items()
            }
