"""Which version sampled which token (proto/version_switches.py): the paged engine records
where a swap between decode steps changed the weights under a running call, serve-mode holds
and the rollout batcher keep it across their concatenations and cuts, the turn carries it
through the bus, validation refuses a malformed one, and the trainer's batch lays out each
token's own version."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch
from transformers import PreTrainedModel

from libs.bus.connection import Bus
from libs.bus.wire import InvalidMessage
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy
from libs.rl.batch import NO_VERSION, build_batch
from libs.rollout.agent import Transcript
from libs.rollout.batcher import _truncated
from libs.serve.holds import generate_in_holds
from libs.tokenizer import ByteTokenizer
from proto.messages import Rollout, ScoredRollout, Turn
from proto.validation import InvalidValue, check_rollout
from tests.test_engine_paged import PROMPTS, wait_for
from tests.test_router_replay import through_the_bus

TOKENIZER = ByteTokenizer()
NORM = "model.norm.weight"


def negate_final_norm(engine: PagedEngine, version: int) -> None:
    """Swap in weights that differ only after the last layer (the final norm negated: every
    logit flips sign, so the greedy token changes at every position while the KV of the
    tokens before is the same under both): a swap between steps, the call running on."""
    live = engine.live_tensors()
    assert live is not None
    engine.write_between_steps(live[NORM].neg_, version)


def greedy_under(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> list[int]:
    """The greedy token at each position of `tokens` given `prompt` and the tokens before it,
    under `model`'s weights computed afresh."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def follows_versions(
    completion: Completion, prompt: list[int], models: dict[int, PreTrainedModel]
) -> bool:
    """Whether every token is its own version's greedy token, the version per token read from
    the completion's switches."""
    tokens = completion.token_ids
    greedy = {v: greedy_under(model, prompt, tokens) for v, model in models.items()}
    bounds = [0, *(index for index, _ in completion.version_switches), len(tokens)]
    versions = [completion.policy_version, *(v for _, v in completion.version_switches)]
    return all(
        tokens[start:end] == greedy[version][start:end]
        for start, end, version in zip(bounds, bounds[1:], versions, strict=False)
    )


@pytest.fixture(scope="module")
def old_weights() -> PreTrainedModel:
    return build_policy(PolicyConfig(device="cpu", seed=0))


def test_a_swap_under_a_running_call_is_recorded_at_the_first_token_it_sampled(
    old_weights: PreTrainedModel,
) -> None:
    engine = PagedEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER, 8)
    running = engine.submit(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1000))
    wait_for(lambda: engine.num_steps > 2)
    negate_final_norm(engine, 5)
    completions = running.result(timeout=300)
    spanned = [c for c in completions if c.version_switches]
    assert spanned, "no completion was still running at the swap"
    models = {0: old_weights, 5: engine.model}
    for c in completions:
        prompt = PROMPTS[c.prompt_index]
        assert c.policy_version == 0
        assert c.policy_version_end == (5 if c.version_switches else None)
        assert len(c.version_switches) <= 1 and follows_versions(c, prompt, models)
    for c in spanned:  # the two versions' greedy tokens differ everywhere: the index is exact
        ((index, version),) = c.version_switches
        assert version == 5 and 0 < index < len(c.token_ids)
        old, new = (greedy_under(m, PROMPTS[c.prompt_index], c.token_ids) for m in models.values())
        assert c.token_ids[index - 1] == old[index - 1] != new[index - 1]
        assert c.token_ids[index] == new[index] != old[index]
    after = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8))
    assert after[0].policy_version == 5 and after[0].version_switches == ()


def test_two_swaps_in_one_call_are_both_recorded(old_weights: PreTrainedModel) -> None:
    engine = PagedEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER, 8)
    negated = copy.deepcopy(old_weights)
    with torch.no_grad():
        negated.get_parameter(NORM).neg_()
    running = engine.submit(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1000))
    wait_for(lambda: engine.num_steps > 2)
    negate_final_norm(engine, 1)
    first_swap_step = engine.num_steps
    wait_for(lambda: engine.num_steps > first_swap_step + 4)
    negate_final_norm(engine, 2)  # back to the first weights, as version 2
    completions = running.result(timeout=300)
    twice = [c for c in completions if len(c.version_switches) == 2]
    assert twice, "no completion ran across both swaps"
    models = {0: old_weights, 1: negated, 2: old_weights}
    for c in twice:
        (first, one), (second, two) = c.version_switches
        assert (one, two) == (1, 2) and 0 < first < second < len(c.token_ids)
        assert c.policy_version_end == 2
    assert all(follows_versions(c, PROMPTS[c.prompt_index], models) for c in completions)


def test_serve_holds_record_a_swap_between_holds_at_the_holds_first_token() -> None:
    engine = HFEngine(build_policy(PolicyConfig(device="cpu", seed=0)), TOKENIZER)
    new_state = build_policy(PolicyConfig(device="cpu", seed=1)).state_dict()
    calls = 0

    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        nonlocal calls
        if calls == 1:  # between the first hold and the second
            engine.update_weights(new_state, 3)
        calls += 1
        return engine.generate(prompts, params)

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    (completion,) = asyncio.run(
        generate_in_holds(generate, PROMPTS[0], 1, greedy, hold_tokens=4, tokenizer=TOKENIZER)
    )
    assert len(completion.token_ids) > 4, "the row stopped inside its first hold"
    assert completion.policy_version == 0 and completion.policy_version_end == 3
    assert completion.version_switches == ((4, 3),)


def test_the_batcher_cuts_the_switches_with_the_tokens() -> None:
    completion = spanning_completion(num_tokens=10, switches=((3, 1), (7, 2)))
    cut = _truncated(completion, 5, 0)
    assert cut.version_switches == ((3, 1),) and cut.policy_version_end == 1
    before_any = _truncated(completion, 3, 0)
    assert before_any.version_switches == () and before_any.policy_version_end is None
    assert _truncated(completion, 10, 0).version_switches == ((3, 1), (7, 2))


def spanning_completion(num_tokens: int, switches: tuple[tuple[int, int], ...]) -> Completion:
    return Completion(
        prompt_index=0,
        sample_index=0,
        token_ids=list(range(65, 65 + num_tokens)),
        logprobs=[-1.0] * num_tokens,
        raw_logprobs=[-1.0] * num_tokens,
        finish_reason="length",
        policy_version=0,
        policy_version_end=switches[-1][1] if switches else None,
        version_switches=switches,
    )


def rollout_with(turn: Turn, rollout_id: str = "r1", prompt: list[int] | None = None) -> Rollout:
    """A one-turn episode: `prompt` (3 tokens if not given), then `turn`."""
    return Rollout(
        rollout_id=rollout_id,
        task_id="t",
        group_id="t",
        sample_index=0,
        env="arith",
        turns=[Turn(role="user", token_ids=prompt or [1, 2, 3]), turn],
        finish_reason="stop",
    )


def worker_turn(completion: Completion) -> Turn:
    """The assistant turn the rollout worker makes of `completion`."""
    transcript = Transcript()
    transcript.add_assistant(completion, "text")
    return transcript.turns[-1]


async def test_the_worker_turn_carries_the_switches_through_the_bus(bus: Bus) -> None:
    turn = worker_turn(spanning_completion(10, ((3, 1), (7, 2))))
    assert turn.version_switches == ((3, 1), (7, 2)) and turn.policy_version_end == 2
    (received,) = await through_the_bus(bus, [rollout_with(turn)])
    assert received.turns[1].version_switches == ((3, 1), (7, 2))
    assert received.turns[1].policy_version_end == 2


@pytest.mark.parametrize(
    ("switches", "end", "reason"),
    [
        (((3, 1), (3, 2)), 2, "not increasing"),
        (((3, 1), (10, 2)), 2, r"not all in 0\.\.9"),
        (((3, 2), (7, 1)), 1, "versions .* are not increasing"),
        (((3, 0),), 0, "versions .* are not increasing"),
        (((3, 1),), 2, "not policy_version_end 2"),
    ],
)
async def test_validation_refuses_malformed_switches_with_the_reason(
    bus: Bus, switches: tuple[tuple[int, int], ...], end: int, reason: str
) -> None:
    turn = dataclasses.replace(
        spanning_completion(10, switches), policy_version_end=end, version_switches=switches
    )
    malformed = rollout_with(worker_turn(turn))
    with pytest.raises(InvalidValue, match=rf"turns\[1\]\.version_switches: .*{reason}"):
        check_rollout(malformed)
    with pytest.raises(InvalidMessage, match=reason) as refused:  # and so does a consumer
        await through_the_bus(bus, [malformed])
    assert refused.value.reason == "invalid"  # its dead-letter reason


def test_the_batch_lays_out_each_tokens_version_and_trains_what_it_did_before() -> None:
    turn = worker_turn(spanning_completion(10, ((3, 1), (7, 2))))
    unrecorded = dataclasses.replace(spanning_completion(10, ()), policy_version_end=2)
    samples = [
        ScoredRollout(rollout=rollout_with(turn), reward=1.0),
        ScoredRollout(rollout=rollout_with(worker_turn(unrecorded), "r2"), reward=0.0),
    ]
    batch = build_batch(samples, [1.0, -1.0], pad_id=0, trainable=lambda v: v >= 0)
    # Entry t is about token t+1: the user turn's 3 tokens, then the assistant's 10.
    versions = batch.token_versions[:, 2:].tolist()
    assert versions[0] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert versions[1] == [0] * 10  # switches unknown: its first token's version throughout
    assert batch.token_versions[:, :2].eq(NO_VERSION).all()
    # Which tokens are trained goes by the turn's first version, switches or not.
    only_version_0 = build_batch(samples, [1.0, -1.0], pad_id=0, trainable=lambda v: v == 0)
    assert only_version_0.loss_mask.equal(batch.loss_mask) and batch.loss_mask.sum() == 20
