"""Engine config and the one factory that builds the backend its `type` names.

engine = build_engine(EngineConfig(), PolicyConfig())               # hf, tiny model, byte tokens
engine = build_engine(EngineConfig(), PolicyConfig(path="ckpt"))    # a folder, its tokenizer
engine = build_engine(EngineConfig(), policy, model=trainer_model)  # over a live model
engine = build_engine(EngineConfig(type="remote", remote_urls=["http://replica:8000/v1"]), policy)

The policy (model and tokenizer) is described once, by `PolicyConfig`; the engine config says
only how to run it.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedModel

from libs.engine.base import InferenceEngine
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.engine.remote import RemoteEngine, RemoteEngineConfig
from libs.policy import PolicyConfig, build_policy, check_vocabulary, load_policy_tokenizer

# Only backends that are built: a config naming another is refused when it is read.
EngineType = Literal["hf", "paged", "remote"]


class LocalEngineConfig(BaseModel):
    """Which backend runs the policy, and how a local one runs it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    type: EngineType = "hf"
    """Backend: "hf" (torch/transformers, in process); "paged" (continuous batching, paged KV
    cache, CUDA graphs: libs.engine.paged; Llama, Qwen2/3, Qwen3-MoE, Mixtral models);
    "remote" (a fleet that speaks the rollout contract over HTTP: libs.engine.remote, the
    remote_* fields)."""
    max_batch_rows: int = Field(64, ge=1)
    """Most sequences decoded together; larger requests run in chunks of this many rows."""
    initial_policy_version: int = Field(0, ge=0)
    """Version reported until the first weight update (the version of the loaded weights)."""
    record_routing: bool = True
    """MoE policies: record the experts each token was routed to, carried on the rollout
    for the trainer's router replay (trainer.router_replay). Off, the trainer routes those
    tokens itself; the paged engine then decodes 3-6% more tokens/s at 64-256 rows of
    moe-1b on an H200 (bench/moe_engine_bench.py). Dense policies record nothing either way."""


class EngineConfig(RemoteEngineConfig, LocalEngineConfig):
    """Which inference backend runs the policy, and how (the rollout-worker's `engine`)."""

    @model_validator(mode="after")
    def _remote_has_urls(self) -> Self:
        if self.type == "remote" and not self.remote_urls:
            raise ValueError(
                "engine.type is remote but engine.remote_urls is empty: set "
                "RLPIPE_ROLLOUT_WORKER_ENGINE_REMOTE_URLS to the fleet's base URLs (…/v1)"
            )
        if self.remote_api_key and self.remote_api_key_file:
            raise ValueError("set engine.remote_api_key or engine.remote_api_key_file, not both")
        return self


def build_engine(
    config: EngineConfig, policy: PolicyConfig, model: PreTrainedModel | None = None
) -> InferenceEngine:
    """The engine `config.type` names, running `policy` with its tokenizer.

    `model` is a model already built from `policy` (the trainer's live one, which its eval
    gate decodes with); without it the engine builds its own. A remote engine builds none:
    the fleet holds the weights (the worker still tokenizes with `policy`'s tokenizer).
    """
    if config.type == "remote":
        return RemoteEngine(config)
    tokenizer = load_policy_tokenizer(policy)
    model = build_policy(policy) if model is None else model
    check_vocabulary(model, tokenizer, policy)
    engine = PagedEngine if config.type == "paged" else HFEngine
    return engine(
        model,
        tokenizer,
        config.max_batch_rows,
        config.initial_policy_version,
        record_routing=config.record_routing,
    )
