"""Tokenizers and the policy library: round trips, logprobs against hand references, I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from libs.engine.model_runner import check_architecture
from libs.policy import (
    POLICY_PRESETS,
    PolicyConfig,
    architecture,
    build_policy,
    save_policy,
    sequence_logprobs,
    token_logprobs,
)
from libs.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_policy(PolicyConfig(preset="tiny", device="cpu", seed=0))


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = load_tokenizer("byte")
    text = "def f(x):\n    return x ** 2  # ünïcode ✓ 🚀"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= token < 256 for token in ids)
    assert isinstance(tokenizer, Tokenizer)


def test_byte_tokenizer_specials_are_distinct_and_cannot_be_forged_by_text() -> None:
    tokenizer = ByteTokenizer()
    specials = {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id}
    assert len(specials) == 3 and min(specials) >= 256
    assert max(tokenizer.special_ids.values()) == tokenizer.vocab_size - 1
    assert tokenizer.eos_id not in tokenizer.encode("<|eos|>")
    ids = [tokenizer.special_ids["<|user|>"], *tokenizer.encode("hi"), tokenizer.eos_id]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special=False) == "<|user|>hi<|eos|>"


def test_byte_tokenizer_decodes_a_cut_character_without_raising() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("é")[:1]  # half of a two-byte character, as sampling can leave it
    assert tokenizer.decode(ids) == "\ufffd"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_local_hf_tokenizer_folder_fits_the_protocol(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hello world") == [2, 3]
    assert tokenizer.decode([2, 3, 1]) == "hello world"
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (1, 1, 4)


def test_load_tokenizer_names_the_fix_for_a_bad_spec() -> None:
    with pytest.raises(ValueError, match="neither 'byte' nor an existing local folder"):
        load_tokenizer("/no/such/folder")


def test_token_logprobs_match_a_hand_computed_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    targets = torch.tensor([0, 1])
    temperature = 2.0
    expected = []
    for row, target in zip(logits.tolist(), targets.tolist(), strict=True):
        scaled = [value / temperature for value in row]
        log_norm = torch.tensor(scaled).exp().sum().log().item()
        expected.append(scaled[target] - log_norm)
    got = token_logprobs(logits, targets, temperature)
    torch.testing.assert_close(got, torch.tensor(expected))


def test_sequence_logprobs_score_each_token_given_its_prefix(model: PreTrainedModel) -> None:
    ids = torch.tensor([[257, 72, 105, 33, 258]])
    logprobs = sequence_logprobs(model, ids, torch.ones_like(ids))
    assert logprobs.shape == (1, 4)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    manual = [(logits[t] - logits[t].exp().sum().log())[ids[0, t + 1]].item() for t in range(4)]
    torch.testing.assert_close(logprobs[0].double(), torch.tensor(manual, dtype=torch.float64))
    assert logprobs.requires_grad, "the trainer backpropagates through these logprobs"


def test_sequence_logprobs_ignore_padding_on_either_side(model: PreTrainedModel) -> None:
    tokens = [72, 101, 108, 108, 111]
    pad = ByteTokenizer().pad_id
    single = sequence_logprobs(model, torch.tensor([tokens]), torch.ones(1, 5, dtype=torch.long))
    left = torch.tensor([[pad, pad, *tokens]])
    right = torch.tensor([[*tokens, pad, pad]])
    left_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    right_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    batch = sequence_logprobs(model, torch.cat([left, right]), torch.cat([left_mask, right_mask]))
    torch.testing.assert_close(batch[0, 2:], single[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1, :4], single[0], atol=1e-5, rtol=0)
    assert batch[0, :2].abs().sum() == 0 and batch[1, 4:].abs().sum() == 0


def test_bf16_policy_logprobs_are_computed_in_fp32() -> None:
    model = build_policy(PolicyConfig(device="cpu", dtype="bfloat16"))
    ids = torch.tensor([[257, 72, 105, 33]])
    with torch.no_grad():
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids))
        logits = model(input_ids=ids).logits[0, :-1].double()
    assert model.dtype == torch.bfloat16 and logprobs.dtype == torch.float32
    reference = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[0].double(), reference, atol=1e-6, rtol=0)


def test_same_seed_gives_identical_weights_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = build_policy(PolicyConfig(device="cpu", seed=7)).state_dict()
    after = torch.rand(1)
    second = build_policy(PolicyConfig(device="cpu", seed=7)).state_dict()
    other = build_policy(PolicyConfig(device="cpu", seed=8)).state_dict()
    assert torch.equal(before, after)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_saved_policy_reloads_with_identical_outputs(
    model: PreTrainedModel, tmp_path: Path
) -> None:
    save_policy(model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "config.json").is_file()
    reloaded = build_policy(PolicyConfig(path=str(tmp_path / "ckpt"), device="cpu"))
    ids = torch.tensor([[257, 1, 2, 3, 4, 5]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(
            sequence_logprobs(model, ids, mask), sequence_logprobs(reloaded, ids, mask)
        )


def test_presets_have_their_documented_sizes() -> None:
    tiny = sum(p.numel() for p in build_policy(PolicyConfig(device="cpu")).parameters())
    assert 300_000 < tiny < 2_000_000
    kwargs = dict(POLICY_PRESETS["qwen2-0.5b"])
    with torch.device("meta"):  # shapes only: no 2 GB allocation in a unit test
        big = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        )
    assert 480e6 < sum(p.numel() for p in big.parameters()) < 510e6


def test_the_agent_preset_is_tens_of_millions_of_params_the_paged_engine_runs() -> None:
    # Over a warm start's trained 1,024-token tokenizer (the SFT overrides the vocabulary).
    config = architecture(PolicyConfig(preset="agent-75m", vocab_size=1024))
    with torch.device("meta"):  # shapes only
        agent = AutoModelForCausalLM.from_config(config)
    assert agent.config.vocab_size == 1024
    assert 20e6 < sum(p.numel() for p in agent.parameters()) < 100e6
    check_architecture(agent)  # raises for what the paged engine cannot run
    head_dim = config.hidden_size // config.num_attention_heads
    assert head_dim & (head_dim - 1) == 0, "its Triton kernels take power-of-two head dims"


def test_the_7b_preset_needs_several_cards_to_train_and_the_paged_engine_runs_it() -> None:
    config = architecture(PolicyConfig(preset="byte-7b"))
    with torch.device("meta"):  # shapes only: 13 GB in bf16
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 6.0e9 < params < 7.0e9
    # fp32 master weights, AdamW's two moments, bf16 weights and gradients: over 100 GB of
    # an H200's 141 before a single activation
    assert params * (4 + 4 + 4 + 2 + 2) > 100e9
    check_architecture(model)


def test_unknown_preset_and_missing_folder_name_the_field() -> None:
    with pytest.raises(ValueError, match="preset 'huge' is unknown"):
        build_policy(PolicyConfig(preset="huge"))
    with pytest.raises(ValueError, match=r"PolicyConfig\.path"):
        build_policy(PolicyConfig(path="/no/such/model"))
