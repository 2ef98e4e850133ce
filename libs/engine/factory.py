"""Engine config and the one factory that builds the backend its `type` names.

engine = build_engine(EngineConfig())                      # hf, tiny model, byte tokens
engine = build_engine(EngineConfig(policy=PolicyConfig(path="ckpt"), tokenizer="ckpt"))
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from libs.engine.base import InferenceEngine
from libs.engine.hf import HFEngine
from libs.policy import PolicyConfig, build_policy
from libs.tokenizer import load_tokenizer

EngineType = Literal["hf", "vllm", "openai"]
NOT_BUILT_YET: dict[str, str] = {
    "vllm": "the vllm engine (production GPUs) is not built yet; use type='hf'",
    "openai": "the openai engine (an OpenAI-compatible server) is not built yet; use type='hf'",
}


class EngineConfig(BaseModel):
    """Which inference backend to run, on which policy and tokenizer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: EngineType = "hf"
    """Backend: "hf" (torch/transformers, in process); "vllm" and "openai" are planned."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Model to load (preset or local folder), its dtype and device."""
    tokenizer: str = "byte"
    """"byte" for the embedded byte tokenizer, else a local folder with tokenizer files."""
    max_batch_rows: int = 64
    """Most sequences decoded together; larger requests run in chunks of this many rows."""
    initial_policy_version: int = 0
    """Version reported until the first weight update (the version of the loaded weights)."""


def build_engine(config: EngineConfig) -> InferenceEngine:
    """The engine `config.type` names, ready to generate."""
    if config.type in NOT_BUILT_YET:
        raise NotImplementedError(NOT_BUILT_YET[config.type])
    tokenizer = load_tokenizer(config.tokenizer)
    model = build_policy(config.policy)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {config.tokenizer!r} has {tokenizer.vocab_size} ids but the model embeds "
            f"{model.config.vocab_size}; set policy.vocab_size >= {tokenizer.vocab_size}"
        )
    return HFEngine(model, tokenizer, config.max_batch_rows, config.initial_policy_version)
