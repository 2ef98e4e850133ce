"""What the trainer refuses to train on, decided per sample, so one sample never stops it.

    routing = policy_routing(model)             # (MoE layers, experts a token), None: dense
    problem = scored_problem(sample, vocab_size=V, routing=routing, trainer_version=7)  # or None
    problem = online_problem(sample, vocab_size=V, routing=routing, trainer_version=7)
    bad = find_failing_samples(model, samples, pad_id=0, max_length=None)  # [(sample, why)]

The first two run on every sample as it is read (before it joins a group or the online
buffer): the checks of proto.validation that need the trainer's knowledge (its vocabulary,
the newest version it made, the routing shape of its MoE) plus "has something to train
on". The third runs only after an optimizer step failed: it replays each sample alone
through batch building and a no-grad forward pass and names the ones that fail there, so
the trainer dead-letters those and trains the rest. A failure no single sample reproduces
is the trainer's own bug: it raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from libs.moe.routing import moe_shape
from libs.policy import sequence_logprobs
from libs.rl import build_batch
from proto.messages import OnlineSample, ScoredRollout
from proto.moe import RoutedExperts
from proto.validation import InvalidValue, check_rollout_for_policy, check_served_for_policy


def scored_problem(
    sample: ScoredRollout,
    *,
    vocab_size: int,
    routing: tuple[int, int] | None,
    trainer_version: int,
) -> str | None:
    """Why the trainer cannot train on `sample`, or None (`routing`: policy_routing)."""
    rollout = sample.rollout
    if not any(turn.role == "assistant" and turn.token_ids for turn in rollout.turns):
        return "no assistant tokens to train on"
    try:
        check_rollout_for_policy(rollout, vocab_size=vocab_size, max_version=trainer_version)
    except InvalidValue as exc:
        return str(exc)
    records = [(f"turns[{i}]", t.routed_experts) for i, t in enumerate(rollout.turns)]
    return routing_problem(records, routing)


def online_problem(
    sample: OnlineSample,
    *,
    vocab_size: int,
    routing: tuple[int, int] | None,
    trainer_version: int,
) -> str | None:
    """Why the trainer cannot train on online `sample`, or None (`routing`: policy_routing)."""
    try:
        check_served_for_policy(
            sample.generation, vocab_size=vocab_size, max_version=trainer_version
        )
    except InvalidValue as exc:
        return str(exc)
    return routing_problem([("generation", sample.generation.routed_experts)], routing)


def policy_routing(model: PreTrainedModel) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of the policy's routing; None for a dense policy."""
    shape = moe_shape(model)
    return None if shape is None else (shape.num_layers, shape.top_k)


def routing_problem(
    records: Sequence[tuple[str, RoutedExperts | None]], routing: tuple[int, int] | None
) -> str | None:
    """Why recorded routing cannot be replayed on this policy, or None: the step would fail
    on it (a dense policy has no router; an MoE's replay needs its own [layers, top_k])."""
    for where, record in records:
        if record is None:
            continue
        if routing is None:
            return f"{where}.routed_experts: MoE routing recorded, but the policy is dense"
        if (record.num_layers, record.top_k) != routing:
            return (
                f"{where}.routed_experts: {record.num_layers} layers x top-{record.top_k}, "
                f"the policy routes {routing[0]} layers x top-{routing[1]}"
            )
    return None


def model_vocab_size(model: PreTrainedModel) -> int:
    """Ids the model can embed (the bound every token id must stay under)."""
    embeddings = model.get_input_embeddings()
    if isinstance(embeddings, torch.nn.Embedding):
        return embeddings.num_embeddings
    return int(model.config.vocab_size)


def find_failing_samples(
    model: PreTrainedModel,
    samples: Sequence[ScoredRollout],
    *,
    pad_id: int,
    max_length: int | None,
) -> list[tuple[ScoredRollout, str]]:
    """The samples that fail on their own in batch building or the forward pass, with why."""
    device = next(model.parameters()).device
    failing = []
    for sample in samples:
        try:
            batch = build_batch([sample], torch.zeros(1), pad_id=pad_id, max_length=max_length)
            batch = batch.to(device)
            with torch.no_grad():
                logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
            if not torch.isfinite(logprobs).all():
                raise ValueError("the policy's logprobs of this sample are not finite")
        except Exception as exc:  # whatever a sample can make fail is that sample's problem
            failing.append((sample, f"{type(exc).__name__}: {exc}"[:1000]))
    return failing
