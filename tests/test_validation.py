"""The contract's checks (proto.validation) and what the trainer refuses per sample
(libs.trainer.refusals): each invalid value named, each real message passing."""

from __future__ import annotations

import msgspec
import pytest
import torch

from libs.bus import wire
from libs.moe.wire import encode_routing
from libs.policy import PolicyConfig, build_policy
from libs.trainer.refusals import (
    find_failing_samples,
    model_vocab_size,
    policy_routing,
    scored_problem,
)
from proto.messages import ScoredRollout, Turn, WeightsStaged
from proto.validation import (
    InvalidValue,
    check_announcement,
    check_announcement_plausible,
    check_message,
)
from tests.poison_support import (
    announcement,
    assistant,
    feedback,
    manifest,
    rollout,
    served,
    task,
)


def scored(turns: list[Turn], reward: float = 1.0) -> ScoredRollout:
    return ScoredRollout(rollout=rollout(turns), reward=reward)


def test_real_messages_pass() -> None:
    for message in (
        task(),
        rollout([Turn(role="user", token_ids=[1, 2]), assistant([3, 4])]),
        scored([assistant([3])]),
        served(),
        feedback(),
        announcement(5),
        announcement(
            6, kind="delta", base_version=5, manifest=manifest(6, base=5),
            snapshot_version=5, chain_length=1,
        ),
        WeightsStaged(version=3, file_name="v3.safetensors", num_bytes=10),
    ):  # fmt: skip
        check_message(message)


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (task(group_size=0), "group_size"),
        (task(min_policy_version=-1), "min_policy_version"),
        (task(env="a.b"), "env"),
        (rollout([assistant([1], version=None)]), "policy_version"),
        (rollout([assistant([1, 2], logprobs=[-1.0])]), "logprobs"),
        (rollout([assistant([1], version=-2)]), "policy_version"),
        (rollout([assistant([1], logprobs=[float("nan")])]), "logprobs"),
        (rollout([Turn(role="user", token_ids=[1], logprobs=[-1.0])]), "logprobs"),
        (rollout([assistant([-1])]), "negative token id"),
        (rollout([assistant([1])], sample_index=3), "sample_index"),
        (scored([assistant([1])], reward=float("inf")), "reward"),
        (served(policy_version=-5), "policy_version"),
        (served(logprobs=[-1.0, -1.0]), "logprobs"),
        (served(policy_version_end=2, version_switches=((1, 2),)), "version_switches"),
        (served(policy_version_end=3, version_switches=((0, 2),)), "version_switches"),
        (WeightsStaged(version=1, file_name="../x", num_bytes=1), "file_name"),
        (WeightsStaged(version=-1, file_name="v1.safetensors", num_bytes=1), "version"),
        (announcement(10**12, manifest=manifest(3)), "version"),
        (announcement(8, manifest=manifest(3)), "manifest 3"),
        (announcement(-1, manifest=manifest(-1), snapshot_version=-1), "version"),
        (announcement(4, kind="delta", base_version=None), "base_version"),
        (announcement(4, version_hash="0" * 32), "version_hash"),
    ],
)
def test_invalid_values_are_named(message: msgspec.Struct, named: str) -> None:
    with pytest.raises(InvalidValue, match=named):
        check_message(message)  # type: ignore[arg-type]


def test_decoding_refuses_an_invalid_message_as_invalid() -> None:
    bad = task(group_size=0)
    with pytest.raises(wire.InvalidMessage) as caught:
        wire.decode(type(bad), wire.encode(bad), wire.headers_for(bad, "x"))
    assert caught.value.reason == "invalid" and "group_size" in str(caught.value)


def test_an_announcement_above_the_newest_version_made_is_refused() -> None:
    check_announcement(announcement(10**9))  # consistent in itself
    check_announcement_plausible(announcement(7), newest_version=7)
    with pytest.raises(InvalidValue, match="above the newest"):
        check_announcement_plausible(announcement(10**9), newest_version=7)


def test_the_trainer_refuses_what_its_policy_cannot_train() -> None:
    ok = scored([Turn(role="user", token_ids=[1]), assistant([2, 3], version=4)])
    assert scored_problem(ok, vocab_size=262, routing=None, trainer_version=4) is None
    outside = scored([assistant([2, 300])])
    assert "vocabulary" in (
        scored_problem(outside, vocab_size=262, routing=None, trainer_version=4) or ""
    )
    future = scored([assistant([2], version=9)])
    assert "above the trainer's 4" in (
        scored_problem(future, vocab_size=262, routing=None, trainer_version=4) or ""
    )
    nothing = scored([Turn(role="user", token_ids=[1])])
    assert "no assistant tokens" in (
        scored_problem(nothing, vocab_size=262, routing=None, trainer_version=4) or ""
    )


def test_routing_the_policy_cannot_replay_is_refused_per_sample() -> None:
    # Replayed as it is, a record of another shape (or any record on a dense policy) would
    # fail the whole optimizer step; refused as the sample is read, it costs only itself.
    moe = build_policy(PolicyConfig(preset="tiny-moe"))
    dense = build_policy(PolicyConfig())
    assert policy_routing(moe) == (4, 2) and policy_routing(dense) is None

    def with_routing(layers: int, top_k: int) -> ScoredRollout:
        ids = torch.zeros(2, layers, top_k, dtype=torch.uint8)
        ids[..., 1:] = 1  # an expert set: ascending ids
        turn = msgspec.structs.replace(
            assistant([2, 3], version=4), routed_experts=encode_routing(ids)
        )
        return scored([turn])

    def problem(sample: ScoredRollout, routing: tuple[int, int] | None) -> str:
        return scored_problem(sample, vocab_size=262, routing=routing, trainer_version=4) or ""

    assert problem(with_routing(4, 2), policy_routing(moe)) == ""
    assert "2 layers x top-2, the policy routes 4 layers x top-2" in problem(
        with_routing(2, 2), policy_routing(moe)
    )
    assert "the policy is dense" in problem(with_routing(4, 2), policy_routing(dense))


def test_the_sample_that_breaks_a_step_is_found_alone() -> None:
    torch.manual_seed(0)
    model = build_policy(PolicyConfig(preset="tiny"))
    good = scored([Turn(role="user", token_ids=[1, 2]), assistant([3, 4])])
    bad = scored([Turn(role="user", token_ids=[1, 2]), assistant([3, model_vocab_size(model) + 5])])
    failing = find_failing_samples(model, [good, bad, good], pad_id=0, max_length=None)
    assert [sample for sample, _ in failing] == [bad] and "Error" in failing[0][1]
