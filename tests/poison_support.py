"""Poison for every subject a service consumes: what an operator (or a bug) could publish.

    cases = poison_cases(env="arith")      # [Poison(subject, kind, payload, headers, refuser)]

Kinds: random bytes, a wrong schema (another type's header, or another type's body with no
header), missing fields, oversized (more than the contract allows, under the server's
payload limit), and semantically invalid values (versions, token ids, lengths, names).
`refuser` is the consumer that must dead-letter it (the `consumer` of its dead letter).
tests/test_poison.py publishes them into a running `rlpipe demo`.
"""

# The cases below are a table, one per line or two: long lines read better than wrapped ones.
# ruff: noqa: E501

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec

from libs.bus import wire
from proto import subjects
from proto.messages import (
    WEIGHT_FORMAT_VERSION,
    ChunkRef,
    FeedbackEvent,
    Message,
    OnlineSample,
    Rollout,
    SamplingSettings,
    ScoredRollout,
    ServedGeneration,
    Task,
    Turn,
    WeightAnnouncement,
    WeightManifest,
    WeightsStaged,
)
from proto.validation import MAX_EPISODE_TOKENS, MAX_PROMPT_CHARS


@dataclass(frozen=True)
class Poison:
    subject: str
    kind: str  # random_bytes | wrong_schema | missing_fields | oversized | invalid_values
    what: str
    payload: bytes
    refuser: str
    headers: dict[str, str] = field(default_factory=dict)


def encoded(message: Message, msg_id: str) -> tuple[bytes, dict[str, str]]:
    return wire.encode(message), wire.headers_for(message, msg_id)


def _raw(schema: str, body: dict[str, object], msg_id: str) -> tuple[bytes, dict[str, str]]:
    """A body built by hand (fields a struct would refuse to hold), under `schema`'s header."""
    headers = {wire.MSG_ID_HEADER: msg_id, wire.SCHEMA_HEADER: schema}
    return msgspec.msgpack.encode(body), headers


def task(**overrides: object) -> Task:
    fields: dict[str, object] = {"task_id": "poison-task", "env": "arith", "prompt": "1+1="}
    return Task(**(fields | overrides))  # type: ignore[arg-type]


def rollout(turns: list[Turn], **overrides: object) -> Rollout:
    fields: dict[str, object] = {
        "rollout_id": "poison-rollout",
        "task_id": "poison-task",
        "group_id": "poison-task",
        "sample_index": 0,
        "env": "arith",
        "turns": turns,
        "finish_reason": "stop",
        "task": task(),
    }
    return Rollout(**(fields | overrides))  # type: ignore[arg-type]


def assistant(ids: list[int], version: int | None = 0, logprobs: list[float] | None = None) -> Turn:
    return Turn(
        role="assistant",
        token_ids=ids,
        logprobs=[-1.0] * len(ids) if logprobs is None else logprobs,
        policy_version=version,
    )


def served(**overrides: object) -> ServedGeneration:
    fields: dict[str, object] = {
        "generation_id": "poison-gen",
        "policy_version": 0,
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3],
        "logprobs": [-0.5],
        "sampling": SamplingSettings(),
    }
    return ServedGeneration(**(fields | overrides))  # type: ignore[arg-type]


def feedback(**overrides: object) -> FeedbackEvent:
    fields: dict[str, object] = {
        "event_id": "poison-event",
        "generation_id": "poison-gen",
        "product": "demo",
        "signal": "accepted",
        "occurred_at": 1.0,
    }
    return FeedbackEvent(**(fields | overrides))  # type: ignore[arg-type]


def manifest(version: int, base: int | None = None, **overrides: object) -> WeightManifest:
    fields: dict[str, object] = {
        "format_version": WEIGHT_FORMAT_VERSION,
        "version": version,
        "base_version": base,
        "base_hash": None if base is None else "0" * 32,
        "target_hash": "f" * 32,
        "tensors": [],
        "removed": [],
        "chunks": [],
    }
    return WeightManifest(**(fields | overrides))  # type: ignore[arg-type]


def announcement(version: int, **overrides: object) -> WeightAnnouncement:
    fields: dict[str, object] = {
        "version": version,
        "base_version": None,
        "kind": "snapshot",
        "manifest": manifest(version),
        "version_hash": "f" * 32,
        "snapshot_version": version,
        "chain_length": 0,
        "model_bytes": 0,
        "encoded_bytes": 0,
    }
    return WeightAnnouncement(**(fields | overrides))  # type: ignore[arg-type]


def _common(subject: str, refuser: str, schema: str, other: Message, n: str) -> list[Poison]:
    """Random bytes, wrong schema (twice), missing fields: the same for every subject."""
    wrong_body, _ = encoded(other, f"{n}-wrong-body")
    return [
        Poison(subject, "random_bytes", "512 random bytes", os.urandom(512), refuser,
               {wire.MSG_ID_HEADER: f"{n}-random"}),
        Poison(subject, "wrong_schema", "another type's header", wrong_body, refuser,
               {wire.MSG_ID_HEADER: f"{n}-wrong-header", wire.SCHEMA_HEADER: other.schema_id()}),
        Poison(subject, "wrong_schema", "another type's body, no header", wrong_body, refuser,
               {wire.MSG_ID_HEADER: f"{n}-wrong-body"}),
        Poison(subject, "missing_fields", "an empty map", msgspec.msgpack.encode({}), refuser,
               {wire.MSG_ID_HEADER: f"{n}-missing", wire.SCHEMA_HEADER: schema}),
    ]  # fmt: skip


def _case(
    subject: str, kind: str, what: str, refuser: str, pair: tuple[bytes, dict[str, str]]
) -> Poison:
    payload, headers = pair
    return Poison(subject, kind, what, payload, refuser, headers)


def poison_cases(env: str = "arith") -> list[Poison]:
    """Every consumed subject, every kind."""
    big = [0] * (MAX_EPISODE_TOKENS + 1)  # 1 byte each in msgpack: ~4 MB
    cases: list[Poison] = []

    s, r = subjects.task_subject(env), "rollout-worker"
    cases += _common(s, r, Task.schema_id(), feedback(), "p-task")
    cases += [
        _case(s, "oversized", "a 4 MiB prompt", r,
              encoded(task(task_id="p-task-big", prompt="x" * (MAX_PROMPT_CHARS + 1)), "p-task-big")),
        _case(s, "invalid_values", "group_size 0", r,
              encoded(task(task_id="p-task-g0", group_size=0), "p-task-g0")),
        _case(s, "invalid_values", "negative min_policy_version", r,
              encoded(task(task_id="p-task-neg", min_policy_version=-3), "p-task-neg")),
        _case(s, "invalid_values", "env that is no subject token", r,
              encoded(task(task_id="p-task-env", env="a.b"), "p-task-env")),
    ]  # fmt: skip

    s, r = subjects.rollout_raw_subject(env), "reward"
    cases += _common(s, r, Rollout.schema_id(), task(), "p-raw")
    cases += [
        _case(s, "oversized", "4M+1 tokens", r,
              encoded(rollout([Turn(role="user", token_ids=big)], rollout_id="p-raw-big"), "p-raw-big")),
        _case(s, "invalid_values", "assistant turn without policy_version", r,
              encoded(rollout([assistant([1, 2], version=None)], rollout_id="p-raw-nov"), "p-raw-nov")),
        _case(s, "invalid_values", "3 token ids, 1 logprob", r,
              encoded(rollout([assistant([1, 2, 3], logprobs=[-1.0])], rollout_id="p-raw-len"), "p-raw-len")),
        _case(s, "invalid_values", "sample_index beyond group_size", r,
              encoded(rollout([assistant([1])], rollout_id="p-raw-idx", sample_index=7), "p-raw-idx")),
    ]  # fmt: skip

    s, r = subjects.ROLLOUTS_SCORED, "trainer"
    cases += _common(s, r, ScoredRollout.schema_id(), task(), "p-scored")

    def scored(turns: list[Turn], rid: str, reward: float = 1.0) -> tuple[bytes, dict[str, str]]:
        return encoded(
            ScoredRollout(rollout=rollout(turns, rollout_id=rid, group_id=rid), reward=reward), rid
        )

    cases += [
        _case(s, "oversized", "4M+1 tokens", r, scored([Turn(role="user", token_ids=big)], "p-sc-big")),
        _case(s, "invalid_values", "assistant turn with a null policy_version", r,
              scored([assistant([1, 2], version=None)], "p-sc-nov")),
        _case(s, "invalid_values", "token ids outside the vocabulary", r,
              scored([assistant([1, 10**6])], "p-sc-vocab")),
        _case(s, "invalid_values", "a version the trainer never made", r,
              scored([assistant([1, 2], version=10**9)], "p-sc-future")),
        _case(s, "invalid_values", "NaN reward", r, scored([assistant([1, 2])], "p-sc-nan", float("nan"))),
        _case(s, "invalid_values", "positive logprobs", r,
              scored([assistant([1, 2], logprobs=[3.0, 1.0])], "p-sc-lp")),
    ]  # fmt: skip

    s, r = subjects.WEIGHTS_STAGED, "weight-broadcaster"
    cases += _common(s, r, WeightsStaged.schema_id(), task(), "p-staged")
    cases += [
        _case(s, "oversized", "a 300-character file name", r,
              encoded(WeightsStaged(version=10**6, file_name="v" * 300, num_bytes=1), "p-st-big")),
        _case(s, "invalid_values", "a path out of the staging folder", r,
              encoded(WeightsStaged(version=10**6, file_name="../../etc/passwd", num_bytes=1), "p-st-path")),
        _case(s, "invalid_values", "negative version", r,
              encoded(WeightsStaged(version=-1, file_name="v1.safetensors", num_bytes=1), "p-st-neg")),
    ]  # fmt: skip

    r = "weight-receiver"
    for kind in ("delta", "snapshot"):
        s = subjects.weights_announce_subject(kind)
        n = f"p-ann-{kind}"
        cases += _common(s, r, WeightAnnouncement.schema_id(), task(), n)
        cases += [
            _case(s, "oversized", "a chunk of 1 TB", r, encoded(announcement(
                10**6, manifest=manifest(10**6, chunks=[ChunkRef(index=0, num_bytes=2**40,
                payload_hash="0", tensors=[])])), f"{n}-big")),
            _case(s, "invalid_values", "version 10**12 on another version's manifest", r,
                  encoded(announcement(10**12, manifest=manifest(3)), f"{n}-huge")),
            _case(s, "invalid_values", "negative version", r,
                  encoded(announcement(-4, manifest=manifest(-4), snapshot_version=-4), f"{n}-neg")),
            _case(s, "invalid_values", "consistent, but above every version made", r,
                  encoded(announcement(10**9), f"{n}-future")),
        ]  # fmt: skip

    s, r = subjects.SERVING_GENERATIONS, "feedback-joiner-generations"
    cases += _common(s, r, ServedGeneration.schema_id(), task(), "p-gen")
    cases += [
        _case(s, "oversized", "4M+1 prompt tokens", r,
              encoded(served(generation_id="p-gen-big", prompt_token_ids=big), "p-gen-big")),
        _case(s, "invalid_values", "negative policy_version", r,
              encoded(served(generation_id="p-gen-neg", policy_version=-5), "p-gen-neg")),
        _case(s, "invalid_values", "policy_version 10**12", r,
              encoded(served(generation_id="p-gen-huge", policy_version=10**12), "p-gen-huge")),
        _case(s, "invalid_values", "1 completion token, 2 logprobs", r,
              encoded(served(generation_id="p-gen-len", logprobs=[-1.0, -1.0]), "p-gen-len")),
    ]  # fmt: skip

    s, r = subjects.FEEDBACK_EVENTS, "feedback-joiner-events"
    cases += _common(s, r, FeedbackEvent.schema_id(), task(), "p-fb")
    event = msgspec.to_builtins(feedback())
    cases += [
        _case(s, "oversized", "a 1 KB user hash", r,
              _raw(FeedbackEvent.schema_id(), event | {"user_hash": "u" * 1024}, "p-fb-big")),
        _case(s, "invalid_values", "negative occurred_at", r,
              _raw(FeedbackEvent.schema_id(), event | {"occurred_at": -5.0}, "p-fb-neg")),
        _case(s, "invalid_values", "an unknown signal", r,
              _raw(FeedbackEvent.schema_id(), event | {"signal": "loved"}, "p-fb-sig")),
    ]  # fmt: skip

    s, r = subjects.ROLLOUTS_ONLINE, "trainer-online"
    cases += _common(s, r, OnlineSample.schema_id(), task(), "p-online")

    def online(gen: ServedGeneration, sid: str) -> tuple[bytes, dict[str, str]]:
        sample = OnlineSample(
            sample_id=sid, generation=gen, feedback=feedback(generation_id=gen.generation_id)
        )
        return encoded(sample, sid)

    cases += [
        _case(s, "oversized", "4M+1 prompt tokens", r, online(served(prompt_token_ids=big), "p-on-big")),
        _case(s, "invalid_values", "negative policy_version", r,
              online(served(policy_version=-1), "p-on-neg")),
        _case(s, "invalid_values", "a version the trainer never made", r,
              online(served(policy_version=10**9), "p-on-future")),
        _case(s, "invalid_values", "token ids outside the vocabulary", r,
              online(served(completion_token_ids=[10**6]), "p-on-vocab")),
    ]  # fmt: skip
    return cases
