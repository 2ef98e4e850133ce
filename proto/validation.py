"""What a decoded message must satisfy before any consumer changes state because of it.

    check_message(message)                        # ranges and invariants of its own fields
    check_rollout_for_policy(rollout, vocab_size=V, max_version=trainer_version)
    check_served_for_policy(generation, vocab_size=V, max_version=trainer_version)
    check_announcement_plausible(announcement, newest_version=kv_policy_version)

Each raises `InvalidValue` (a ValueError) naming the field and why; `libs.bus.wire.decode`
calls `check_message` on every message it decodes, so a message that fails it is
dead-lettered as "invalid" by every consumer (PullConsumer, StreamReader, the weight
receiver) before its handler runs. The checks that need what only the consumer knows (the
model's vocabulary, the newest version the trainer made) take it as an argument and are
called by that consumer. One place per message type; plain Python, no heavy imports.

Bounds are generous (far above anything the pipeline produces), so a real message never
fails them; they exist so a forged or corrupted one cannot, e.g., claim version 10**18 and
make every real version look older.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from proto.messages import (
    EnvResetRequest,
    FeedbackEvent,
    Message,
    OnlineSample,
    Rollout,
    ScoredRollout,
    ServedGeneration,
    Task,
    Turn,
    WeightAnnouncement,
    WeightManifest,
    WeightsStaged,
)
from proto.moe import RoutedExperts
from proto.version_switches import switches_problem

# A trainer stepping once a second needs 68 years to reach this.
MAX_POLICY_VERSION = 2**31 - 1
MAX_GROUP_SIZE = 4096
MAX_TURNS = 10_000
MAX_EPISODE_TOKENS = 4 * 1024 * 1024
MAX_ID_CHARS = 512
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
# MoE routing: far above any model's MoE layers and experts per token (Kimi K2: 60 x 8).
MAX_ROUTED_LAYERS = 1024
MAX_ROUTED_TOP_K = 64
# A zstd frame of incompressible ids is at most a few dozen bytes longer than the ids.
ROUTED_FRAME_OVERHEAD_BYTES = 1024
# Logprobs are <= 0; float32 rounding of a near-certain token may land a hair above.
LOGPROB_SLACK = 1e-3


class InvalidValue(ValueError):
    """A message whose fields are out of range or inconsistent: it can never be handled."""


def check_message(message: Message) -> None:
    """Raise InvalidValue when `message` breaks its type's invariants (no-op for types with
    none: env steps and replies, dead letters, decisions)."""
    check = _CHECKS.get(type(message))
    if check is not None:
        check(message)


# --- per message type ----------------------------------------------------------------------


def check_task(task: Task) -> None:
    _check_id("task_id", task.task_id)
    _check_token("env", task.env)
    _require(len(task.prompt) <= MAX_PROMPT_CHARS, f"prompt longer than {MAX_PROMPT_CHARS}")
    _require(
        1 <= task.group_size <= MAX_GROUP_SIZE,
        f"group_size {task.group_size} not in 1..{MAX_GROUP_SIZE}",
    )
    _check_version("min_policy_version", task.min_policy_version)
    _require(_finite(task.created_at), "created_at must be finite")


def check_turn(turn: Turn, where: str) -> None:
    num_tokens = len(turn.token_ids)
    _require(min(turn.token_ids, default=0) >= 0, f"{where}: negative token id")
    if turn.role == "assistant":
        _require(
            turn.policy_version is not None,
            f"{where}: assistant turn without policy_version (the engine records one)",
        )
        _require(
            len(turn.logprobs) == num_tokens,
            f"{where}: {num_tokens} token ids but {len(turn.logprobs)} logprobs",
        )
    else:
        _require(not turn.logprobs, f"{where}: a {turn.role} turn carries logprobs")
    if turn.policy_version is not None:
        _check_version(f"{where}.policy_version", turn.policy_version)
    _check_switches(
        f"{where}.version_switches",
        turn.policy_version,
        turn.policy_version_end,
        turn.version_switches,
        num_tokens,
    )
    _check_logprobs(f"{where}.logprobs", turn.logprobs)
    if turn.routed_experts is not None:
        _check_routed_experts(turn.routed_experts, num_tokens, f"{where}.routed_experts")
    _require(turn.segment >= 0, f"{where}: negative segment")


def _check_switches(
    where: str,
    first: int | None,
    end: int | None,
    switches: tuple[tuple[int, int], ...],
    num_tokens: int,
) -> None:
    """Version switches of `num_tokens` tokens from `first` to `end` (proto.version_switches)."""
    for _, version in switches:
        _check_version(where, version)
    problem = switches_problem(first, end, switches, num_tokens)
    _require(problem is None, f"{where}: {problem}")


def _check_routed_experts(routed: RoutedExperts, num_tokens: int, where: str) -> None:
    _require(
        0 <= routed.num_tokens <= num_tokens,
        f"{where}: routing for {routed.num_tokens} tokens of a turn of {num_tokens}",
    )
    _require(
        1 <= routed.num_layers <= MAX_ROUTED_LAYERS and 1 <= routed.top_k <= MAX_ROUTED_TOP_K,
        f"{where}: {routed.num_layers} layers x top-{routed.top_k} outside "
        f"1..{MAX_ROUTED_LAYERS} x 1..{MAX_ROUTED_TOP_K}",
    )
    raw_bytes = routed.num_tokens * routed.num_layers * routed.top_k * 2
    _require(
        len(routed.data) <= raw_bytes + ROUTED_FRAME_OVERHEAD_BYTES,
        f"{where}: {len(routed.data)} bytes for {routed.num_tokens} tokens' routing",
    )


def check_rollout(rollout: Rollout) -> None:
    for name in ("rollout_id", "task_id", "group_id"):
        _check_id(name, getattr(rollout, name))
    _check_token("env", rollout.env)
    # No turn at all is possible (an episode that timed out at once): refused by the trainer.
    _require(len(rollout.turns) <= MAX_TURNS, f"{len(rollout.turns)} turns > {MAX_TURNS}")
    num_tokens = sum(len(turn.token_ids) for turn in rollout.turns)
    _require(num_tokens <= MAX_EPISODE_TOKENS, f"{num_tokens} tokens > {MAX_EPISODE_TOKENS}")
    for index, turn in enumerate(rollout.turns):
        check_turn(turn, f"turns[{index}]")
    if rollout.task is not None:
        check_task(rollout.task)
        _require(
            rollout.task.task_id == rollout.task_id,
            f"task_id {rollout.task_id!r} but task.task_id {rollout.task.task_id!r}",
        )
        _require(
            0 <= rollout.sample_index < rollout.task.group_size,
            f"sample_index {rollout.sample_index} not in 0..{rollout.task.group_size - 1}",
        )
    else:
        _require(rollout.sample_index >= 0, f"negative sample_index {rollout.sample_index}")
    _require(all(_finite(v) for v in rollout.stats.values()), "stats must be finite")


def check_scored_rollout(scored: ScoredRollout) -> None:
    check_rollout(scored.rollout)
    _require(_finite(scored.reward), f"reward {scored.reward} is not finite")
    for criterion in scored.criteria:
        _require(
            _finite(criterion.weight) and _finite(criterion.score),
            f"criterion {criterion.name!r}: weight and score must be finite",
        )
    _require(
        any(turn.role == "assistant" for turn in scored.rollout.turns),
        "no assistant turn to train on",
    )


def check_manifest(manifest: WeightManifest) -> None:
    # Which formats this code can decode is the codec's call (libs.weights.format).
    _require(manifest.format_version >= 1, f"manifest format {manifest.format_version} < 1")
    _check_version("manifest.version", manifest.version)
    _require(
        (manifest.base_version is None) == (manifest.base_hash is None),
        "manifest: base_version and base_hash must be both set or both absent",
    )
    for entry in manifest.tensors:
        _require(all(d >= 0 for d in entry.shape), f"tensor {entry.name!r}: negative dimension")
        _require(entry.num_changed >= 0, f"tensor {entry.name!r}: negative num_changed")
    indexes = [chunk.index for chunk in manifest.chunks]
    _require(indexes == list(range(len(indexes))), "manifest chunks must be indexed 0..n-1")
    for chunk in manifest.chunks:
        _require(
            0 < chunk.num_bytes <= MAX_CHUNK_BYTES,
            f"chunk {chunk.index}: num_bytes {chunk.num_bytes} not in 1..{MAX_CHUNK_BYTES}",
        )


def check_announcement(announcement: WeightAnnouncement) -> None:
    """Self-consistency: the announcement says what its manifest says (the chunks are
    fetched by the manifest's version and verified against its hashes, so a version that
    disagrees with its manifest would be applied under a number it is not)."""
    a, manifest = announcement, announcement.manifest
    _check_version("version", a.version)
    check_manifest(manifest)
    _require(manifest.version == a.version, f"version {a.version} but manifest {manifest.version}")
    _require(
        manifest.base_version == a.base_version,
        f"base_version {a.base_version} but manifest {manifest.base_version}",
    )
    _require(a.version_hash == manifest.target_hash, "version_hash is not the manifest's")
    if a.kind == "snapshot":
        _require(a.base_version is None, "a snapshot has no base_version")
        _require(
            a.snapshot_version == a.version and a.chain_length == 0,
            "a snapshot starts its own chain (snapshot_version == version, chain_length 0)",
        )
    else:
        _require(
            a.base_version is not None and 0 <= a.base_version < a.version,
            f"a delta's base_version {a.base_version} must be below its version {a.version}",
        )
        _require(
            0 <= a.snapshot_version <= (a.base_version or 0) and a.chain_length >= 1,
            "a delta's chain starts at a snapshot at or below its base, length >= 1",
        )
        _require(
            a.chain_length <= a.version - a.snapshot_version,
            f"chain_length {a.chain_length} longer than versions {a.snapshot_version}..{a.version}",
        )
    _require(a.model_bytes >= 0 and a.encoded_bytes >= 0, "negative byte counts")


def check_announcement_plausible(announcement: WeightAnnouncement, newest_version: int) -> None:
    """Refuse a version above the newest the trainer recorded as taken (the trainer writes
    it before staging any version, so no real announcement is above it)."""
    _require(
        announcement.version <= newest_version,
        f"version {announcement.version} is above the newest the trainer made "
        f"({newest_version}): not a version of this run",
    )


def check_weights_staged(staged: WeightsStaged) -> None:
    _check_version("version", staged.version)
    name = staged.file_name
    _require(
        0 < len(name) <= 255 and "/" not in name and "\\" not in name and name not in (".", ".."),
        f"file_name {name!r} must be a plain file name in the staging folder",
    )
    _require(staged.num_bytes > 0, f"num_bytes {staged.num_bytes} must be positive")
    if staged.kind == "delta":
        base = staged.base_version
        _require(base is not None, "a staged delta names its base_version")
        assert base is not None
        _check_version("base_version", base)
        _require(base < staged.version, f"base_version {base} is not below {staged.version}")


def check_served_generation(generation: ServedGeneration) -> None:
    _check_id("generation_id", generation.generation_id)
    _check_version("policy_version", generation.policy_version)
    ids = generation.prompt_token_ids + generation.completion_token_ids
    _require(len(ids) <= MAX_EPISODE_TOKENS, f"{len(ids)} tokens > {MAX_EPISODE_TOKENS}")
    _require(min(ids, default=0) >= 0, "negative token id")
    _require(
        len(generation.logprobs) == len(generation.completion_token_ids),
        f"{len(generation.completion_token_ids)} completion tokens but "
        f"{len(generation.logprobs)} logprobs",
    )
    _check_logprobs("logprobs", generation.logprobs)
    _check_switches(
        "version_switches",
        generation.policy_version,
        generation.policy_version_end,
        generation.version_switches,
        len(generation.completion_token_ids),
    )
    if generation.routed_experts is not None:
        _check_routed_experts(generation.routed_experts, len(ids), "routed_experts")


def check_feedback_event(event: FeedbackEvent) -> None:
    # Ranges and patterns are part of the schema (msgspec.Meta): checked while decoding.
    _require(event.value is None or _finite(event.value), "value must be finite")


def check_online_sample(sample: OnlineSample) -> None:
    _check_id("sample_id", sample.sample_id)
    check_served_generation(sample.generation)
    check_feedback_event(sample.feedback)
    _require(
        sample.feedback.generation_id == sample.generation.generation_id,
        f"feedback rates {sample.feedback.generation_id!r}, not the joined generation "
        f"{sample.generation.generation_id!r}",
    )


# --- checks that need the consumer's knowledge ---------------------------------------------


def check_rollout_for_policy(rollout: Rollout, *, vocab_size: int, max_version: int) -> None:
    """Token ids inside the model's vocabulary; no turn from a version the trainer never
    made (`max_version`: the trainer's own, the newest there is)."""
    for index, turn in enumerate(rollout.turns):
        _check_vocab(f"turns[{index}]", turn.token_ids, vocab_size)
        if turn.policy_version is not None:
            _require(
                turn.policy_version <= max_version,
                f"turns[{index}].policy_version {turn.policy_version} is above the trainer's "
                f"{max_version}: no such version was made",
            )
        newest = max((version for _, version in turn.version_switches), default=0)
        _require(
            newest <= max_version,
            f"turns[{index}].version_switches name version {newest}, above the trainer's "
            f"{max_version}: no such version was made",
        )


def check_served_for_policy(
    generation: ServedGeneration, *, vocab_size: int, max_version: int
) -> None:
    """As `check_rollout_for_policy`, for a served generation."""
    _check_vocab("prompt_token_ids", generation.prompt_token_ids, vocab_size)
    _check_vocab("completion_token_ids", generation.completion_token_ids, vocab_size)
    newest = max(
        [generation.policy_version, *(version for _, version in generation.version_switches)]
    )
    _require(
        newest <= max_version,
        f"the generation names version {newest}, above the trainer's {max_version}: "
        "no such version was made",
    )


# --- helpers -------------------------------------------------------------------------------


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise InvalidValue(problem)


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _check_id(name: str, value: str) -> None:
    _require(0 < len(value) <= MAX_ID_CHARS, f"{name} must have 1..{MAX_ID_CHARS} characters")


def _check_token(name: str, value: str) -> None:
    _require(
        bool(value) and len(value) <= 128 and not any(c in value for c in ".*> \t\r\n"),
        f"{name} {value[:40]!r} cannot be a subject token (letters, digits, '-', '_')",
    )


def _check_version(name: str, version: int) -> None:
    _require(
        0 <= version <= MAX_POLICY_VERSION,
        f"{name} {version} not in 0..{MAX_POLICY_VERSION}",
    )


def _check_logprobs(name: str, logprobs: Sequence[float]) -> None:
    # Builtins over the list (C loops: a 200k-token turn costs a few ms, not tens): a NaN
    # or an infinity anywhere makes the sum non-finite; max catches a positive logprob.
    _require(
        math.isfinite(sum(logprobs)) and max(logprobs, default=0.0) <= LOGPROB_SLACK,
        f"{name} must be finite and <= 0",
    )


def _check_vocab(where: str, token_ids: Sequence[int], vocab_size: int) -> None:
    largest = max(token_ids, default=-1)
    _require(
        largest < vocab_size,
        f"{where}: token id {largest} outside the vocabulary (size {vocab_size})",
    )


def check_env_reset_request(request: EnvResetRequest) -> None:
    _check_id("episode_id", request.episode_id)
    check_task(request.task)


_CHECKS: dict[type[Message], Callable[[Any], None]] = {
    Task: check_task,
    EnvResetRequest: check_env_reset_request,
    Rollout: check_rollout,
    ScoredRollout: check_scored_rollout,
    WeightAnnouncement: check_announcement,
    WeightsStaged: check_weights_staged,
    ServedGeneration: check_served_generation,
    FeedbackEvent: check_feedback_event,
    OnlineSample: check_online_sample,
}
