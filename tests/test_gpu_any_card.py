"""GPU paths on a card other than the thread's current one (issue #33, item 1).

CUDA's current device is per thread and card 0 unless set; Triton kernels, new streams,
events and graph captures go to it, not to their tensors' card (a worker on card 1 crashed
in a Triton kernel). Each test runs its component on the last card while the current device
stays card 0, and compares with card 0. They need two GPUs and skip otherwise (the MoE
engine's test of the same is in test_engine_paged_moe.py).

Run: python -m pytest tests/test_gpu_any_card.py -q   (on a host with 2+ GPUs)
"""

from __future__ import annotations

import pytest
import torch

from libs.cuda_device import cuda_device_of, on_device_of, recorded_event
from libs.engine.base import SamplingParams
from libs.engine.paged import PagedEngine
from libs.policy import PolicyConfig, build_policy
from libs.tokenizer import ByteTokenizer
from libs.trainer.staging import HostBuffers

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA GPU")
TOKENIZER = ByteTokenizer()


def last_card() -> str:
    return f"cuda:{torch.cuda.device_count() - 1}"


@TWO_GPUS
def test_gpu_paged_engine_on_another_card_decodes_as_on_card_0() -> None:
    """Fused Triton kernels, CUDA graphs, sampling kernels: tokens equal card 0's."""
    assert torch.cuda.current_device() == 0
    prompts = [list(range(10 + p, 40 + p)) for p in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=48, seed=7)
    runs = []
    for device in ("cuda:0", last_card()):
        model = build_policy(PolicyConfig(preset="byte-0.5b", device=device))
        engine = PagedEngine(model, TOKENIZER, 16, kv_cache_tokens=8192)
        assert engine.runner.uses_cuda_graphs and engine.runner.use_kernel
        runs.append(engine.generate(prompts, params, num_samples=4))
    assert torch.cuda.current_device() == 0
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert [c.logprobs for c in runs[0]] == [c.logprobs for c in runs[1]]


@TWO_GPUS
def test_gpu_trainer_stages_a_state_held_on_another_card() -> None:
    """The stager's copy stream and its ready event belong to the state's card."""
    device = torch.device(last_card())
    state = {
        name: torch.randn(size, device=device).to(torch.bfloat16)
        for name, size in (("a", 1 << 20), ("b", 4097))
    }
    ready = recorded_event(device)
    host = HostBuffers().copy(state, ready)
    for name, tensor in state.items():
        assert host[name].device.type == "cpu"
        assert torch.equal(host[name], tensor.cpu())


def test_on_a_cpu_nothing_is_switched_and_no_card_is_named() -> None:
    tensors = [torch.zeros(2), torch.ones(3)]
    assert cuda_device_of(tensors) is None
    with on_device_of(tensors[0]), on_device_of(torch.device("cpu")):
        assert torch.equal(tensors[0] + 1, torch.ones(2))
