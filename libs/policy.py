"""The policy: a causal LM built from a named preset or loaded from a local folder.

The trainer and the `hf` inference engine both get their model here, so both see the same
architecture, dtype rules and logprob arithmetic:

    config = PolicyConfig(preset="tiny")          # ~0.8M params, fp32 on a laptop CPU
    model = build_policy(config)                   # seeded random init, eval mode
    tokenizer = load_policy_tokenizer(config)      # byte, or the model folder's own
    logprobs = sequence_logprobs(model, ids, mask) # [B, T-1], the trainer's view
    save_policy(model, "run/ckpt")                 # config.json + model.safetensors
    model = build_policy(PolicyConfig(path="run/ckpt"))

`PolicyConfig` is the one description of the policy: every service that loads it (trainer,
rollout-worker) nests it in its settings (`RLPIPE_<SERVICE>_POLICY_<FIELD>`), so both read
the same fields with the same defaults. Nothing is downloaded: a folder is read with
`local_files_only=True`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

from libs.policy_presets import POLICY_PRESETS
from libs.tokenizer import BYTE_TOKENIZER_SPEC, Tokenizer, load_tokenizer

# transformers draws a tqdm bar on stderr for every model load and save ("Loading weights",
# "Writing model shards"): in the services' JSON logs and beside the SFT's own progress it is
# noise, one per checkpoint. Every model of the project is loaded and saved here.
transformers_logging.disable_progress_bar()

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


# Files whose presence in a model folder means it carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PolicyConfig(BaseModel):
    """Which model to build, with which tokenizer, where, and in what precision."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    preset: str = "tiny"
    """Name in POLICY_PRESETS; ignored when `path` is set."""
    path: str | None = None
    """Local folder with config.json and safetensors weights; overrides `preset`."""
    tokenizer: str | None = None
    """"byte" or a local folder with tokenizer files; unset: the model folder's own tokenizer
    when `path` holds one, else "byte"."""
    vocab_size: int | None = Field(None, ge=1)
    """Override of the preset's vocabulary size (must cover the tokenizer's ids)."""
    dtype: DTypeName = "auto"
    """Parameter dtype; "auto" is float32 on CPU and bfloat16 on GPU."""
    device: str = "auto"
    """torch device ("cpu", "cuda", "cuda:1"); "auto" picks cuda when available."""
    seed: int = 0
    """Seed of the random init (the same seed gives bit-identical weights on any device)."""


def tokenizer_spec(config: PolicyConfig) -> str:
    """The tokenizer `config` names: its `tokenizer`, else the model folder when it holds
    tokenizer files, else the byte tokenizer."""
    if config.tokenizer is not None:
        return config.tokenizer
    if config.path is not None and any((Path(config.path) / f).is_file() for f in TOKENIZER_FILES):
        return config.path
    return BYTE_TOKENIZER_SPEC


def load_policy_tokenizer(config: PolicyConfig) -> Tokenizer:
    """The policy's tokenizer (`tokenizer_spec`)."""
    return load_tokenizer(tokenizer_spec(config))


def check_vocabulary(model: PreTrainedModel, tokenizer: Tokenizer, config: PolicyConfig) -> None:
    """Raise ValueError when the model cannot embed every id of the tokenizer."""
    model_vocab = int(model.config.vocab_size)
    if tokenizer.vocab_size > model_vocab:
        raise ValueError(
            f"tokenizer {tokenizer_spec(config)!r} has {tokenizer.vocab_size} ids but the model "
            f"embeds {model_vocab}; set policy.vocab_size >= {tokenizer.vocab_size} "
            "(RLPIPE_<SERVICE>_POLICY_VOCAB_SIZE) or pair the model with its own tokenizer"
        )


def resolve_device(name: str) -> torch.device:
    """The torch device named in config; "auto" is cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: DTypeName, device: torch.device) -> torch.dtype:
    """The parameter dtype named in config; "auto" is bf16 on GPU, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_policy(config: PolicyConfig) -> PreTrainedModel:
    """The model named by `config`, on its device and dtype, in eval mode.

    From a preset the weights are a seeded random init, made on CPU in fp32 and then moved,
    so a seed means the same starting point on a laptop and on a GPU.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.path is not None:
        return load_policy(config.path, dtype=dtype, device=device)
    model = _init_from_preset(config)
    return _place(model, device, dtype)


def architecture(config: PolicyConfig) -> PretrainedConfig:
    """The transformers config of the model `config` names, without building the model."""
    if config.path is not None:
        if not Path(config.path).is_dir():
            raise ValueError(
                f"policy path {config.path!r} is not a folder; check PolicyConfig.path"
            )
        return AutoConfig.from_pretrained(config.path, local_files_only=True)
    if config.preset not in POLICY_PRESETS:
        raise ValueError(
            f"policy preset {config.preset!r} is unknown; choose one of {sorted(POLICY_PRESETS)} "
            "or set `path` to a local model folder"
        )
    kwargs = dict(POLICY_PRESETS[config.preset])
    if config.vocab_size is not None:
        kwargs["vocab_size"] = config.vocab_size
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _init_from_preset(config: PolicyConfig) -> PreTrainedModel:
    """Random-init fp32 CPU model of `config.preset`, without touching the global RNG state."""
    hf_config = architecture(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model


def load_policy(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Model saved in `folder` (config.json + safetensors), in eval mode; never downloads."""
    if not Path(folder).is_dir():
        raise ValueError(f"policy path {str(folder)!r} is not a folder; check PolicyConfig.path")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    return _place(model, torch.device(device), dtype)


def _place(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """`model` moved to `device` and cast to `dtype` (in place), in eval mode."""
    # transformers decorates PreTrainedModel.to with functools.wraps(nn.Module.to), which
    # mypy reads as an unbound function; at runtime this is the ordinary Module.to.
    model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters in their own dtypes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def save_policy(model: PreTrainedModel, folder: str | Path) -> None:
    """Write `model` to `folder` as config.json + safetensors, loadable by `load_policy`."""
    model.save_pretrained(folder, safe_serialization=True)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions [B, T] counting only attended tokens, so left padding does not shift RoPE.

    Padded slots get position 0; their outputs are masked everywhere they could matter.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of `targets` [...] under softmax(`logits` [..., V] / temperature).

    Computed in fp32 whatever the logits' dtype: a bf16 log_softmax over a large vocabulary
    loses about two decimal digits, which shows up directly as train/inference mismatch.
    """
    scaled = logits.float() / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - log_norm


def sequence_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of each token given its prefix: [B, T-1], entry t scores input_ids[:, t+1].

    `input_ids` and `attention_mask` are [B, T], padded on either side. Entries whose target
    is padding, or is a row's first real token (it has no prefix), are 0. To score only
    completions, multiply by `completion_mask[:, 1:]`.
    Gradients flow (this is the trainer's forward); wrap in torch.no_grad() to just score.
    """
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logprobs = token_logprobs(outputs.logits[:, :-1], input_ids[:, 1:], temperature)
    scored = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    # where, not a multiply: a padded slot's logit may be non-finite, and 0 * nan is nan.
    return torch.where(scored, logprobs, torch.zeros_like(logprobs))
