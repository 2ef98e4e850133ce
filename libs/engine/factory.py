"""Engine config and the one factory that builds the backend its `type` names.

engine = build_engine(EngineConfig(), PolicyConfig())               # hf, tiny model, byte tokens
engine = build_engine(EngineConfig(), PolicyConfig(path="ckpt"))    # a folder, its tokenizer
engine = build_engine(EngineConfig(), policy, model=trainer_model)  # over a live model

The policy (model and tokenizer) is described once, by `PolicyConfig`; the engine config says
only how to run it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from libs.engine.base import InferenceEngine
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy, check_vocabulary, load_policy_tokenizer

# Only backends that are built: a config naming another is refused when it is read.
EngineType = Literal["hf", "paged"]


class EngineConfig(BaseModel):
    """Which inference backend runs the policy, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    type: EngineType = "hf"
    """Backend: "hf" (torch/transformers, in process); "paged" (continuous batching, paged KV
    cache, CUDA graphs: libs.engine.paged; Llama/Qwen2 models)."""
    max_batch_rows: int = Field(64, ge=1)
    """Most sequences decoded together; larger requests run in chunks of this many rows."""
    initial_policy_version: int = Field(0, ge=0)
    """Version reported until the first weight update (the version of the loaded weights)."""


def build_engine(
    config: EngineConfig, policy: PolicyConfig, model: PreTrainedModel | None = None
) -> InferenceEngine:
    """The engine `config.type` names, running `policy` with its tokenizer.

    `model` is a model already built from `policy` (the trainer's live one, which its eval
    gate decodes with); without it the engine builds its own.
    """
    tokenizer = load_policy_tokenizer(policy)
    model = build_policy(policy) if model is None else model
    check_vocabulary(model, tokenizer, policy)
    if config.type == "paged":
        return PagedEngine(model, tokenizer, config.max_batch_rows, config.initial_policy_version)
    return HFEngine(model, tokenizer, config.max_batch_rows, config.initial_policy_version)
