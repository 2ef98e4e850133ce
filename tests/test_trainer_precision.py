"""The trainer's precision and its weight handover: fp32 master weights keep the small
updates a bf16-only trainer rounds away, and the stager ships the newest version without
holding the trainer up (a real nats-server, real staging files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.policy import PolicyConfig
from libs.trainer.config import TrainerConfig, default_learning_rate
from libs.trainer.delta_encoder import DeltaEncoder, DeltaEncoderError
from libs.trainer.precision import TrainingPrecision
from libs.trainer.staging import WeightStager
from libs.weights.container import read_delta_file
from libs.weights.encoder import EncodeOptions
from libs.weights.handoff import load_staged, staged_versions
from libs.weights.hashing import state_hash
from libs.weights.tensors import as_raw, raw_state
from proto import streams
from proto.messages import WeightsStaged

BF16_POLICY = PolicyConfig(preset="tiny", device="cpu", dtype="bfloat16")


def small_updates(master: str, steps: int = 5) -> float:
    """Fraction of published (bf16) values changed by `steps` AdamW steps at lr 1e-5."""
    precision = TrainingPrecision.for_policy(master, BF16_POLICY)  # type: ignore[arg-type]
    model = precision.build_model(BF16_POLICY)
    before = precision.published_copy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        optimizer.zero_grad()
        with precision.compute():
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
    after = precision.published_copy(model)
    changed = sum(int((after[k] != before[k]).sum()) for k in after)
    return changed / sum(t.numel() for t in after.values())


def test_fp32_master_weights_keep_updates_that_bf16_rounds_away() -> None:
    # lr 1e-5 is below half a bf16 ulp of most weights: in bf16 alone those steps are lost
    # (measured: 16% of values moved in bf16, 66% with fp32 masters).
    assert small_updates("policy") < 0.25
    assert small_updates("fp32") > 0.5


def test_mixed_precision_trains_fp32_computes_and_publishes_in_the_policy_dtype() -> None:
    precision = TrainingPrecision.for_policy("fp32", BF16_POLICY)
    model = precision.build_model(BF16_POLICY)
    assert precision.mixed and {p.dtype for p in model.parameters()} == {torch.float32}
    with precision.compute():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.bfloat16
    published = precision.published_copy(model)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    next(model.parameters()).data.add_(1.0)  # the trainer's next step
    name = next(iter(published))
    assert not torch.equal(published[name].float(), model.state_dict()[name])


def test_learning_rate_and_staleness_default_by_model_size_unless_set() -> None:
    tiny, half_billion = TrainerConfig().sized_for(821_000), TrainerConfig().sized_for(492_000_000)
    assert (tiny.learning_rate, tiny.max_staleness) == (5e-4, 4)
    assert (half_billion.learning_rate, half_billion.max_staleness) == (1e-5, 8)
    assert default_learning_rate(492_000_000) == 1e-5
    set_by_user = TrainerConfig(learning_rate=3e-6, max_staleness=0).sized_for(492_000_000)
    assert (set_by_user.learning_rate, set_by_user.max_staleness) == (3e-6, 0)


@pytest.fixture
async def stager_bus(bus: Bus) -> Bus:
    await provision(bus.js)
    await bus.js.purge_stream(streams.WEIGHTS_STAGED.name)
    return bus


async def test_the_stager_ships_the_newest_version_and_skips_those_it_replaced(
    stager_bus: Bus, tmp_path: Path
) -> None:
    stager = WeightStager(Publisher(stager_bus.js), tmp_path)
    states = {v: {"w": torch.full((1024,), float(v))} for v in range(1, 5)}
    await stager.offer(states[1], 1)
    await stager.flush()
    for version in (2, 3, 4):  # offered faster than staged: each replaces the one waiting
        await stager.offer(states[version], version, step=version)
    await stager.flush()
    assert staged_versions(tmp_path) == [1, 4] and stager.num_skipped == 2
    size = (tmp_path / "v4.safetensors").stat().st_size
    newest = load_staged(
        tmp_path, WeightsStaged(version=4, file_name="v4.safetensors", num_bytes=size)
    )
    assert bytes(newest["w"].data) == bytes(as_raw(states[4]["w"]).data)
    info = await stager_bus.js.stream_info(streams.WEIGHTS_STAGED.name)
    assert info.state.messages == 2  # one WeightsStaged per version shipped


async def test_a_failed_handover_is_raised_not_lost(stager_bus: Bus, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the staging folder should be")
    stager = WeightStager(Publisher(stager_bus.js), blocked)
    await stager.offer({"w": torch.zeros(4)}, 1)
    with pytest.raises(OSError):
        await stager.flush()
    await stager.offer({"w": torch.zeros(4)}, 2)
    with pytest.raises(OSError):
        await stager.flush()
    info = await stager_bus.js.stream_info(streams.WEIGHTS_STAGED.name)
    assert info.state.messages == 0


async def test_the_delta_encoder_process_reports_its_failures_and_death(tmp_path: Path) -> None:
    encoder = DeltaEncoder(tmp_path, EncodeOptions())
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with pytest.raises(DeltaEncoderError, match="no version adopted"):
        await encoder.encode(state, 2)
    digest = await encoder.adopt(state, 1)
    assert digest == state_hash(raw_state(state))
    changed = {"w": state["w"].clone()}
    changed["w"][3] = -1.0
    delta = await encoder.encode(changed, 2)
    assert (delta.version, delta.base_version, delta.file_name) == (2, 1, "v2.delta")
    assert 0 < delta.diff_s < delta.encode_s
    manifest, _ = read_delta_file(tmp_path / delta.file_name)
    assert manifest.target_hash == delta.target_hash == state_hash(raw_state(changed))
    encoder._process.kill()  # a crash: the next request says so instead of hanging
    with pytest.raises(DeltaEncoderError, match="died"):
        await encoder.encode(changed, 3)
    # The next one starts a new process, with no chain: adopt again.
    with pytest.raises(DeltaEncoderError, match="no version adopted"):
        await encoder.encode(changed, 3)
    assert await encoder.adopt(changed, 3) == delta.target_hash
    await encoder.close()
    with pytest.raises(DeltaEncoderError, match="closed"):
        await encoder.adopt(state, 4)
