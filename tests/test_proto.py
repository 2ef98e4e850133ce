"""The wire contract: every message round-trips, the schema header guards decoding, and
the JSON Schema on disk matches the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from libs.bus import wire
from proto import schema, subjects
from proto.fleet import (
    FleetCommand,
    FleetCommandReply,
    FleetDecision,
    RecallRecord,
    ReplicaLoad,
    ReplicaStatus,
)
from proto.messages import (
    ChunkRef,
    CriterionScore,
    DeadLetter,
    EnvCloseReply,
    EnvCloseRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    FeedbackEvent,
    Message,
    OnlineSample,
    PolicyIdentity,
    PromotionDecision,
    Rollout,
    SamplingSettings,
    ScoredRollout,
    ServedGeneration,
    Task,
    TensorEntry,
    Turn,
    WeightAnnouncement,
    WeightManifest,
    WeightsStaged,
)
from proto.same_host import SameHostShelf, SameHostVersion, SharedSlot, SharedTensor
from proto.schema import ALL_MESSAGES

TASK = Task(task_id="t1", env="add", prompt="12+30=", group_size=8, spec={"answer": 42})
ROLLOUT = Rollout(
    rollout_id="r1",
    task_id="t1",
    group_id="g1",
    sample_index=3,
    env="add",
    turns=[
        Turn(role="user", token_ids=[1, 2, 3]),
        Turn(role="assistant", token_ids=[52, 50], logprobs=[-0.1, -2.5], policy_version=7),
    ],
    finish_reason="stop",
    task=TASK,
)
GENERATION = ServedGeneration(
    generation_id="gen-1",
    policy_version=7,
    prompt_token_ids=[1, 2],
    completion_token_ids=[3],
    logprobs=[-0.5],
    sampling=SamplingSettings(temperature=0.7),
)
FEEDBACK = FeedbackEvent(
    event_id="e1", generation_id="gen-1", product="ide", signal="accepted", occurred_at=1.0
)
EXAMPLES: list[Message] = [
    FleetCommand(command_id="c1", replica_id="replica-2", action="lend", reason="off-peak"),
    FleetCommandReply(command_id="c1", replica_id="replica-2", accepted=True, role="serving"),
    ReplicaStatus(
        replica_id="replica-2",
        role="serving",
        ready=True,
        policy_version=4,
        promoted_version=4,
        load=ReplicaLoad(window_s=20.0, requests_per_s=1.5, p50_latency_s=0.2, p99_latency_s=0.9),
        last_recall=RecallRecord(
            tasks_in_flight=2,
            tasks_finished=1,
            tasks_requeued=1,
            requeued_task_ids=["t9"],
            hash_matches=True,
        ),
        at=1.0,
    ),
    FleetDecision(decision_id="d1", action="recall", replica_id="replica-2", reason="peak"),
    TASK,
    ROLLOUT,
    ScoredRollout(
        rollout=ROLLOUT, reward=1.0, criteria=[CriterionScore(name="exact", weight=1.0, score=1.0)]
    ),
    WeightAnnouncement(
        version=8,
        base_version=7,
        kind="delta",
        manifest=WeightManifest(
            format_version=1,
            version=8,
            base_version=7,
            base_hash="ab",
            target_hash="ef",
            tensors=[
                TensorEntry(
                    name="w", dtype="BF16", shape=[2, 2], change="delta", digest="cd", num_changed=1
                )
            ],
            removed=[],
            chunks=[ChunkRef(index=0, num_bytes=10, payload_hash="12", tensors=["w"])],
        ),
        version_hash="ef",
        snapshot_version=5,
        chain_length=3,
        model_bytes=8,
        encoded_bytes=10,
    ),
    WeightsStaged(version=8, file_name="v8.safetensors", num_bytes=1234),
    SameHostShelf(
        shelf_id="5f0c",
        host_id="gpu-node-1a2b3c4d",
        kind="posix_shm",
        slots=[SharedSlot(size_bytes=4352, shm_name="rlpipe_5f0c_0")],
        tensors=[
            SharedTensor(name="lm_head.weight", dtype="bfloat16", shape=[32, 64], offset_bytes=0)
        ],
    ),
    SameHostVersion(shelf_id="5f0c", version=9, slot=1, checksum=-12345, step=9, published_at=1.5),
    EnvResetRequest(episode_id="ep1", task=TASK),
    EnvResetReply(episode_id="ep1", observation="12+30=", max_tokens=3, stop=["\n"]),
    EnvStepRequest(episode_id="ep1", action="42"),
    EnvStepReply(episode_id="ep1", done=True, info={"answer": "42"}),
    EnvCloseRequest(episode_id="ep1"),
    EnvCloseReply(episode_id="ep1", error="unknown_episode", error_message="no such episode"),
    GENERATION,
    FEEDBACK,
    OnlineSample(sample_id="s1", generation=GENERATION, feedback=FEEDBACK),
    PromotionDecision(
        version=20,
        promoted=False,
        candidate_score=0.5,
        baseline_version=10,
        baseline_score=0.75,
        margin=0.02,
        num_tasks=32,
        reason="candidate 0.5000 < promoted v10 0.7500 - margin 0.02",
    ),
    PolicyIdentity(
        tokenizer="/models/mine",
        tokenizer_hash="9f2c" * 8,
        tokenizer_vocab_size=151_665,
        model_type="qwen2",
        model_vocab_size=151_936,
        tensors_hash="03ab" * 8,
    ),
    DeadLetter(
        origin_subject="rl.tasks.add",
        origin_stream="RL_TASKS",
        consumer="rollout-worker",
        reason="undecodable",
        error="not msgpack",
        num_delivered=1,
        stream_sequence=5,
        payload=b"\xc1",
    ),
]


def test_every_message_type_has_an_example_and_a_unique_schema_id() -> None:
    assert {type(m) for m in EXAMPLES} == set(ALL_MESSAGES)
    ids = [m.schema_id() for m in ALL_MESSAGES]
    assert len(set(ids)) == len(ids) and all(i.endswith("/1") for i in ids)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_message_round_trips_through_the_wire_encoding(message: Message) -> None:
    headers = wire.headers_for(message, msg_id="id-1")
    decoded = wire.decode(type(message), wire.encode(message), headers)
    assert decoded == message
    assert headers[wire.SCHEMA_HEADER] == type(message).schema_id()


def test_a_message_of_another_schema_is_refused_before_decoding() -> None:
    headers = wire.headers_for(FEEDBACK, msg_id="x")
    with pytest.raises(wire.InvalidMessage) as caught:
        wire.decode(Task, wire.encode(FEEDBACK), headers)
    assert caught.value.reason == "schema_mismatch"


def test_missing_fields_and_garbage_are_reported_with_their_reason() -> None:
    with pytest.raises(wire.InvalidMessage) as missing:
        wire.decode(Task, wire.encode(Turn(role="user", token_ids=[])), None)
    assert missing.value.reason == "invalid" and "task_id" in str(missing.value)
    with pytest.raises(wire.InvalidMessage) as garbage:
        wire.decode(Task, b"\xc1\xc1", None)
    assert garbage.value.reason == "undecodable"


def test_a_newer_producer_adding_a_field_is_still_understood() -> None:
    import msgspec

    newer = msgspec.msgpack.encode({**msgspec.to_builtins(TASK), "priority": 3})
    assert wire.decode(Task, newer, None) == TASK


def test_subject_tokens_refuse_dots_and_wildcards() -> None:
    assert subjects.task_subject("add") == "rl.tasks.add"
    for bad in ("a.b", "*", ">", "", "a b"):
        with pytest.raises(ValueError, match="subject token"):
            subjects.task_subject(bad)


def test_json_schema_on_disk_is_fresh() -> None:
    assert schema.stale_files() == [], "run `make schema` and commit proto/schema/"


def test_schema_check_command_fails_on_a_stale_file(tmp_path: Path) -> None:
    schema.write_all(tmp_path)
    assert schema.stale_files(tmp_path) == []
    (tmp_path / "task.v1.json").write_text("{}")
    (tmp_path / "gone.v1.json").write_text("{}")
    assert schema.stale_files(tmp_path) == ["gone.v1.json", "task.v1.json"]
    result = subprocess.run(
        [sys.executable, "-m", "proto.schema", "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
