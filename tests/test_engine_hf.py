"""The `hf` engine on the tiny CPU model: sampling semantics, recorded logprobs, weight swaps."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from libs.engine.base import Completion, SamplingParams
from libs.engine.factory import EngineConfig, build_engine
from libs.engine.hf import HFEngine
from libs.engine.sampling import nucleus_logprobs
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
PROMPTS = [TOKENIZER.encode(text) for text in ("Q: 2+2=", "hello", "x")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def make_engine(seed: int = 0) -> HFEngine:
    return HFEngine(
        build_policy(PolicyConfig(device="cpu", seed=seed)), TOKENIZER, max_batch_rows=64
    )


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return make_engine()


def recomputed_logprobs(
    engine: HFEngine, completions: list[Completion], temperature: float = 1.0
) -> list[torch.Tensor]:
    """The trainer's view: score prompt + completion as one right-padded batch."""
    sequences = [PROMPTS[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), width), TOKENIZER.pad_id)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    with torch.no_grad():
        logprobs = sequence_logprobs(engine.model, ids, mask, temperature)
    return [
        logprobs[row, len(PROMPTS[c.prompt_index]) - 1 : len(sequences[row]) - 1]
        for row, c in enumerate(completions)
    ]


def test_each_prompt_gets_a_group_of_samples_in_order(engine: HFEngine) -> None:
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=6, seed=0), num_samples=4)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (p, s) for p in range(3) for s in range(4)
    ]
    for c in completions:
        assert 1 <= len(c.token_ids) <= 6
        assert len(c.logprobs) == len(c.raw_logprobs) == len(c.token_ids)
        assert c.policy_version == engine.policy_version == 0
    group = [tuple(c.token_ids) for c in completions[:4]]
    assert len(set(group)) > 1, "samples of one group must differ, or GRPO has no signal"


def test_max_tokens_caps_length_and_reports_length(engine: HFEngine) -> None:
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=3, seed=1), num_samples=8)
    for c in completions:
        assert len(c.token_ids) <= 3
        ended_by_eos = c.token_ids[-1] == TOKENIZER.eos_id
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
    assert any(c.finish_reason == "length" for c in completions)


def test_stop_token_ends_the_completion_and_is_kept(engine: HFEngine) -> None:
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    stop_id = free[5]
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_id,))
    )[0]
    first = free.index(stop_id)
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish_reason == "stop"


def test_stop_string_ends_at_the_token_that_completes_it(engine: HFEngine) -> None:
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    text = TOKENIZER.decode(free)
    stop = next(ch for ch in text[3:] if ch != "\ufffd")
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_strings=(stop,))
    stopped = engine.generate(PROMPTS[:1], params)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free[: len(stopped.token_ids)]
    assert stop in TOKENIZER.decode(stopped.token_ids)
    assert stop not in TOKENIZER.decode(stopped.token_ids[:-1])


def test_sampling_logprobs_equal_the_trainers_recomputed_logprobs(engine: HFEngine) -> None:
    """Train/inference mismatch at the same version: zero up to fp32 rounding."""
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=16, seed=2), num_samples=3)
    for c, trainer in zip(completions, recomputed_logprobs(engine, completions), strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), trainer, atol=1e-5, rtol=0)


def test_temperature_logprobs_match_the_trainer_at_that_temperature(engine: HFEngine) -> None:
    params = SamplingParams(temperature=0.5, max_tokens=12, seed=3)
    completions = engine.generate(PROMPTS, params, num_samples=2)
    at_temperature = recomputed_logprobs(engine, completions, temperature=0.5)
    at_one = recomputed_logprobs(engine, completions)
    for c, scaled, plain in zip(completions, at_temperature, at_one, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), scaled, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), plain, atol=1e-5, rtol=0)


def test_nucleus_keeps_the_smallest_top_set_and_renormalizes() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    got = nucleus_logprobs(probs.log(), top_p=0.7).exp()
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    only_top = nucleus_logprobs(probs.log(), top_p=0.01).exp()
    torch.testing.assert_close(only_top, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_top_p_samples_only_inside_the_nucleus(engine: HFEngine) -> None:
    top_p = 0.3
    params = SamplingParams(temperature=0.2, top_p=top_p, max_tokens=10, seed=4)
    completions = engine.generate(PROMPTS, params, num_samples=4)
    for c in completions:
        ids = torch.tensor([PROMPTS[c.prompt_index] + c.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(PROMPTS[c.prompt_index]) - 1 : -1]
        probs = (logits.double() / 0.2).softmax(-1)
        for step, token in enumerate(c.token_ids):
            mass_before = probs[step][probs[step] > probs[step, token]].sum().item()
            assert mass_before < top_p, "sampled a token outside the nucleus"
            cumulative = probs[step].sort(descending=True).values.cumsum(0)
            nucleus_mass = cumulative[(cumulative < top_p).sum()].item()
            expected = (probs[step, token] / nucleus_mass).log().item()
            assert c.logprobs[step] == pytest.approx(expected, abs=1e-4)


def test_same_seed_same_samples_other_seed_other_samples(engine: HFEngine) -> None:
    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=8, seed=seed)
        return [c.token_ids for c in engine.generate(PROMPTS, params, num_samples=2)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(engine: HFEngine) -> None:
    # A stop id taken from one row makes rows finish at different steps (batch compaction).
    stop_id = engine.generate(PROMPTS[1:2], GREEDY)[0].token_ids[4]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_id,))
    batched = engine.generate(PROMPTS, params)
    alone = [engine.generate([prompt], params)[0] for prompt in PROMPTS]
    assert len({len(c.token_ids) for c in batched}) > 1
    for b, a in zip(batched, alone, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.logprobs == [0.0] * len(b.token_ids), "greedy samples from a point mass"
        torch.testing.assert_close(
            torch.tensor(b.raw_logprobs), torch.tensor(a.raw_logprobs), atol=1e-5, rtol=0
        )


def test_weight_update_is_in_place_and_makes_the_engine_the_new_policy() -> None:
    engine = make_engine(seed=0)
    storage = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    before = engine.generate(PROMPTS, GREEDY)
    new_policy = build_policy(PolicyConfig(device="cpu", seed=1))
    pause_s = engine.update_weights(new_policy.state_dict(), version=3)
    after = engine.generate(PROMPTS, GREEDY)
    assert pause_s >= 0
    assert engine.policy_version == 3 and all(c.policy_version == 3 for c in after)
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == storage
    assert (
        engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    )
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    reference = HFEngine(new_policy, TOKENIZER).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in reference]


def test_bad_weight_updates_are_rejected_before_touching_weights() -> None:
    engine = make_engine(seed=0)
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    embed = engine.model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="lacks"):
        engine.update_weights({"model.embed_tokens.weight": embed + 1, "nope": embed}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.embed_tokens.weight": embed[:3]}, version=1)
    engine.update_weights({"model.norm.weight": engine.model.model.norm.weight * 2}, version=2)
    with pytest.raises(ValueError, match="older"):
        engine.update_weights({}, version=1)
    after = engine.model.state_dict()
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert torch.equal(after["model.norm.weight"], before["model.norm.weight"] * 2)
    assert engine.policy_version == 2


def test_requests_that_cannot_be_served_name_the_problem(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(PROMPTS, SamplingParams(max_tokens=engine.max_context_tokens))
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[TOKENIZER.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_factory_builds_hf_and_a_config_refuses_backends_not_built() -> None:
    cpu = PolicyConfig(device="cpu")
    engine = build_engine(EngineConfig(), cpu)
    assert isinstance(engine, HFEngine)
    assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].token_ids
    for backend in ("vllm", "openai"):
        with pytest.raises(ValidationError, match="'hf', 'paged' or 'remote'"):
            EngineConfig(type=backend)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"policy\.vocab_size"):
        build_engine(EngineConfig(), PolicyConfig(device="cpu", vocab_size=100))
