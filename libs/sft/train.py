"""Supervised fine-tuning (the mid-training stage): a policy trained on chat transcripts.

    rlpipe sft --data demos.jsonl --out models/calc-sft [--steps 300] [--policy-path BASE]

or `train_sft(SftConfig(data=..., out=...))`. Each transcript is rendered exactly as the
harness lays out an episode (libs.sft.transcript) and the loss is the mean negative
log-likelihood of the assistant tokens only. The result in `out` is a model folder
(config.json + model.safetensors, and the tokenizer files when the tokenizer is a local HF
one) that the trainer and the rollout-worker load as `policy_path`. On a GPU the weights the
optimizer steps are fp32 (the policy's dtype "auto") and the forward runs in bf16.

Resumable: every `checkpoint_every_steps` the model, the optimizer and the step are written to
`out/checkpoint/`; a rerun with the same config continues from there, and batches are drawn by
(seed, step), so a resumed run trains on the same batches as an uninterrupted one. A finished
run (`out/sft.json` with as many steps) is not trained again.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from libs.chat.template import chat_template_for, save_tokenizer
from libs.durable_files import publish_durably
from libs.policy import PolicyConfig, build_policy, load_policy_tokenizer, save_policy
from libs.sft.loss import Example, sft_loss
from libs.sft.transcript import read_transcripts, render_transcript, without_system_message
from libs.tokenizer import HFTokenizer, Tokenizer

CHECKPOINT_DIR = "checkpoint"
RESULT_FILE = "sft.json"
WARMUP_STEPS = 10


@dataclass(frozen=True)
class SftConfig:
    """One SFT run: data, starting policy, and optimization."""

    data: Path
    out: Path
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The starting policy and its tokenizer (the one policy description, libs.policy); its
    dtype "auto" trains fp32 weights (`training_policy`)."""
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 2e-3
    min_learning_rate_ratio: float = 0.1
    max_sequence_tokens: int = 2048
    checkpoint_every_steps: int = 50
    seed: int = 0
    without_system_message: bool = False
    """Render each transcript without its system message (so without the tool list either):
    short contexts, on which a small model learns to copy from the conversation far sooner
    than behind a 1K-token opening. A first curriculum stage, followed by full transcripts."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every_steps", "max_sequence_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass(frozen=True)
class SftStep:
    """What one optimizer step reports."""

    step: int
    loss: float
    confident_tokens: float
    learning_rate: float


ProgressFn = Callable[[SftStep], None]


def load_examples(config: SftConfig, tokenizer: Tokenizer) -> list[Example]:
    """Every transcript of `config.data`, rendered and cut to `max_sequence_tokens`."""
    template = chat_template_for(tokenizer)
    examples = []
    for transcript in read_transcripts(config.data):
        if config.without_system_message:
            transcript = without_system_message(transcript)
        ids, mask = render_transcript(transcript, template)
        ids, mask = ids[: config.max_sequence_tokens], mask[: config.max_sequence_tokens]
        if any(mask[1:]):
            examples.append(Example(ids, mask))
    if not examples:
        raise ValueError(f"{config.data}: no transcript has assistant tokens to train on")
    return examples


def learning_rate_at(config: SftConfig, step: int) -> float:
    """Linear warmup over WARMUP_STEPS, then cosine decay to min_learning_rate_ratio."""
    if step < WARMUP_STEPS:
        return config.learning_rate * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(config.steps - WARMUP_STEPS, 1)
    floor = config.min_learning_rate_ratio
    return config.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def draw_batch(examples: Sequence[Example], config: SftConfig, step: int) -> list[Example]:
    """The batch of `step`: a function of (seed, step) only, so resuming repeats it."""
    rng = random.Random(f"sft:{config.seed}:{step}")
    return [examples[rng.randrange(len(examples))] for _ in range(config.batch_size)]


def train_sft(config: SftConfig, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Train (or finish training) the policy of `config`; returns the result written to
    `out/sft.json`."""
    done = finished_result(config)
    if done is not None:
        return done
    tokenizer = load_policy_tokenizer(config.policy)
    examples = load_examples(config, tokenizer)
    model, optimizer, start = _setup(config, tokenizer)
    started, last = time.monotonic(), SftStep(start, float("nan"), float("nan"), 0.0)
    model.train()
    for step in range(start, config.steps):
        last = _optimize(
            model, optimizer, config, step, draw_batch(examples, config, step), tokenizer
        )
        if progress:
            progress(last)
        if (step + 1) % config.checkpoint_every_steps == 0 and step + 1 < config.steps:
            _save_checkpoint(model, optimizer, config, step + 1)
    model.eval()
    return _finish(model, tokenizer, config, examples, last, time.monotonic() - started)


def _optimize(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    config: SftConfig,
    step: int,
    batch: list[Example],
    tokenizer: Tokenizer,
) -> SftStep:
    rate = learning_rate_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = rate
    # On CUDA the forward runs in bf16 over the fp32 weights (`training_policy`); on the CPU
    # in fp32, as the weights are.
    on_cuda = model.device.type == "cuda"
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=on_cuda):
        loss, confident = sft_loss(model, batch, tokenizer.pad_id)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return SftStep(step + 1, float(loss.detach()), confident, rate)


def _setup(
    config: SftConfig, tokenizer: Tokenizer
) -> tuple[PreTrainedModel, torch.optim.Optimizer, int]:
    """The model and optimizer, from the checkpoint when there is one; and the next step."""
    checkpoint = config.out / CHECKPOINT_DIR
    state_path = checkpoint / "state.json"
    policy = training_policy(config.policy, tokenizer)
    if state_path.exists() and json.loads(state_path.read_text()).get("config") == _config_json(
        config
    ):
        model = build_policy(policy.model_copy(update={"path": str(checkpoint)}))
        optimizer = _optimizer(model, config)
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
        return model, optimizer, int(json.loads(state_path.read_text())["step"])
    model = build_policy(policy)
    return model, _optimizer(model, config), 0


def training_policy(policy: PolicyConfig, tokenizer: Tokenizer) -> PolicyConfig:
    """The policy the SFT trains: a preset sized to a trained tokenizer's vocabulary, and
    dtype "auto" made fp32 on every device.

    bf16 weights would not train here: an update below ~1/256 of a bf16 weight rounds away,
    and RMSNorm's weights start at 1.0 against AdamW steps of about the rate (3e-3 decaying
    to 3e-4). So the optimizer steps fp32 weights, and on CUDA the forward runs under bf16
    autocast (`_optimize`): its matrix products in bf16, as with bf16 weights."""
    if policy.path is None and policy.vocab_size is None and isinstance(tokenizer, HFTokenizer):
        policy = policy.model_copy(update={"vocab_size": tokenizer.vocab_size})
    if policy.dtype == "auto":
        policy = policy.model_copy(update={"dtype": "float32"})
    return policy


def _optimizer(model: PreTrainedModel, config: SftConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)


def _save_checkpoint(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, config: SftConfig, step: int
) -> None:
    """Write the checkpoint to a temporary folder and rename it into place, durably."""
    final = config.out / CHECKPOINT_DIR
    staging = config.out / f"{CHECKPOINT_DIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    save_policy(model, staging)
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    (staging / "state.json").write_text(json.dumps({"step": step, "config": _config_json(config)}))
    shutil.rmtree(final, ignore_errors=True)
    publish_durably(staging, final)


def _finish(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    config: SftConfig,
    examples: Sequence[Example],
    last: SftStep,
    elapsed_s: float,
) -> dict[str, Any]:
    save_policy(model, config.out)
    save_tokenizer(tokenizer, config.out)
    result = {
        "steps": config.steps,
        "final_loss": round(last.loss, 4),
        "examples": len(examples),
        "train_s": round(elapsed_s, 1),
        "config": _config_json(config),
    }
    (config.out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(config.out / CHECKPOINT_DIR, ignore_errors=True)
    return result


def finished_result(config: SftConfig) -> dict[str, Any] | None:
    """The result of a finished run of this config in `config.out`, or None."""
    path = config.out / RESULT_FILE
    if not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    return result if result.get("config") == _config_json(config) else None


def _config_json(config: SftConfig) -> dict[str, Any]:
    values = asdict(config)
    values["data"], values["out"] = str(config.data), str(config.out)
    values["policy"] = config.policy.model_dump()
    return values
