"""Checkpoints users can take away: HF folders with the tokenizer and chat template, pruning
that keeps `keep` plus the promoted and best-eval versions, and the version a served
checkpoint reports.

Run: .venv/bin/python -m pytest tests/test_checkpoint.py -q
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.chat.template import ByteChatTemplate, ChatMLTemplate
from libs.envs.client import EnvClient
from libs.policy import PolicyConfig, build_policy, load_policy_tokenizer
from libs.serve.app import ServeConfig
from libs.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from libs.trainer.checkpoint import (
    OPTIMIZER_FILE,
    TrainerState,
    checkpoint_version,
    host_snapshot_writer,
    latest_checkpoint,
    save_checkpoint,
    write_model_and_optimizer,
)
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.host_memory import HostCopy
from libs.trainer.loop import Trainer
from proto.messages import ChatMessage
from services.rollout_worker.settings import RolloutWorkerSettings
from tests.model_folder import build_model_folder
from tests.test_online_rl import (
    arith_gateway,  # noqa: F401  # a fixture, used by name
    decisions,
    online_trainer_config,
    publish_online,
    served_sample,
)

CHAT = [
    ChatMessage(role="system", content="Add."),
    ChatMessage(role="user", content="héllo 12+30="),
    ChatMessage(role="assistant", content="42"),
    ChatMessage(role="tool", content="<tool_result>5</tool_result>"),
]


def save(directory: Path, step: int, version: int, keep: int, protected: set[int]) -> Path:
    model = build_policy(PolicyConfig())
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainerState(step=step, version=version)
    return save_checkpoint(directory, state, model, optimizer, ByteTokenizer(), keep, protected)


def adam_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    optimizer.zero_grad()
    loss.backward()  # type: ignore[union-attr]
    optimizer.step()


def test_a_checkpoint_written_in_the_background_holds_the_trainer_as_it_was_when_taken(
    tmp_path: Path,
) -> None:
    """The trainer writes checkpoints beside training (libs.trainer.loop): the host copy
    taken at a step must be written exactly, whatever the steps after it change."""
    torch.manual_seed(0)
    model = build_policy(PolicyConfig(preset="tiny", dtype="float32"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adam_step(model, optimizer)
    host = HostCopy()
    host_snapshot_writer(model, optimizer, host)  # an earlier copy: its buffers are reused
    adam_step(model, optimizer)
    write_model_and_optimizer(model, optimizer, tmp_path / "in_line")
    snapshot = host_snapshot_writer(model, optimizer, host)
    for group in optimizer.param_groups:
        group["lr"] = 0.5  # a schedule moving on
    adam_step(model, optimizer)  # training goes on before the write
    snapshot(tmp_path / "background")

    in_line = AutoModelForCausalLM.from_pretrained(tmp_path / "in_line")
    background = AutoModelForCausalLM.from_pretrained(tmp_path / "background")
    pairs = zip(in_line.state_dict().items(), background.state_dict().items(), strict=True)
    for (name, a), (other, b) in pairs:
        assert name == other and torch.equal(a, b), name
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), in_line.state_dict().values(), strict=True)
    ), "the later step changed the live weights"
    files = sorted(p.name for p in (tmp_path / "background").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "in_line").iterdir())
    want = torch.load(tmp_path / "in_line" / OPTIMIZER_FILE)
    got = torch.load(tmp_path / "background" / OPTIMIZER_FILE)
    assert got["param_groups"] == want["param_groups"]
    for key, state in want["state"].items():
        for field, value in state.items():
            assert torch.equal(got["state"][key][field], value), (key, field)


def test_a_byte_policy_checkpoint_loads_in_transformers_with_its_tokenizer(tmp_path: Path) -> None:
    folder = save(tmp_path, step=3, version=7, keep=2, protected=set())

    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    byte = ByteTokenizer()
    text = "héllo 12+30=\n\t"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == byte.encode(text)
    assert hf_tokenizer.eos_token_id == byte.eos_id and len(hf_tokenizer) == byte.vocab_size
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert list(ids) == ByteChatTemplate(byte).render(CHAT)
    assert hf_tokenizer.decode([*byte.encode("42"), byte.eos_id], skip_special_tokens=True) == "42"

    model = AutoModelForCausalLM.from_pretrained(folder)
    ours = build_policy(PolicyConfig(path=str(folder)))
    batch = torch.tensor([byte.encode("12+30=")])
    assert torch.equal(model(batch).logits, ours(batch).logits)
    # rlpipe reads the folder's tokenizer back as the byte tokenizer (same ids, same template).
    assert isinstance(load_policy_tokenizer(PolicyConfig(path=str(folder))), ByteTokenizer)


def test_a_user_model_checkpoint_keeps_its_tokenizer_and_chat_template(tmp_path: Path) -> None:
    source = build_model_folder(tmp_path / "model")
    tokenizer = load_tokenizer(str(source))
    assert isinstance(tokenizer, HFTokenizer)
    tokenizer.hf.chat_template = None  # a tokenizer without one gets the ChatML we render
    model = build_policy(PolicyConfig(path=str(source)))
    state = TrainerState(step=1, version=1)
    optimizer = torch.optim.AdamW(model.parameters())
    folder = save_checkpoint(tmp_path / "ckpt", state, model, optimizer, tokenizer, keep=1)

    loaded = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    ids = loaded.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert list(ids) == ChatMLTemplate(tokenizer).render(CHAT)
    AutoModelForCausalLM.from_pretrained(folder)


def test_pruning_keeps_the_newest_and_the_protected_versions(tmp_path: Path) -> None:
    for step in range(1, 7):
        # Versions run 10 ahead of steps (a resumed trainer); 12 serves, 13 scored best.
        save(tmp_path, step=step, version=step + 10, keep=3, protected={12, 13})
    kept = sorted(path.name for path in tmp_path.glob("step-*"))
    assert kept == [f"step-{s:08d}" for s in (2, 3, 4, 5, 6)]
    save(tmp_path, step=7, version=17, keep=3, protected={13})  # 12 no longer serves
    kept = sorted(path.name for path in tmp_path.glob("step-*"))
    assert kept == [f"step-{s:08d}" for s in (3, 5, 6, 7)]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.state.version == 17


def test_best_eval_is_the_highest_held_out_score() -> None:
    state = TrainerState(step=0, version=0)
    assert state.note_eval(10, 0.5)
    assert not state.note_eval(20, 0.5)  # a tie keeps the earlier version
    assert state.note_eval(30, 0.75)
    assert (state.best_eval_version, state.best_eval_score) == (30, 0.75)


def test_a_replica_serving_a_checkpoint_reports_its_version(tmp_path: Path) -> None:
    folder = save(tmp_path, step=150, version=153, keep=2, protected=set())
    assert checkpoint_version(folder) == 153
    fixed = RolloutWorkerSettings(
        policy=PolicyConfig(path=str(folder)), follow_weights=False, serve=ServeConfig(port=8000)
    )
    assert fixed.engine_config().initial_policy_version == 153
    # A replica following the trainer starts from whatever the trainer announces.
    following = RolloutWorkerSettings(policy=PolicyConfig(path=str(folder)))
    assert following.engine_config().initial_policy_version == 0
    assert checkpoint_version(build_model_folder(tmp_path / "model")) is None


async def test_the_trainer_keeps_the_promoted_and_best_eval_checkpoints_beyond_keep(
    bus: Bus,
    tmp_path: Path,
    arith_gateway: EnvClient,  # noqa: F811  # the fixture imported above
) -> None:
    await provision(bus.js)
    for index in range(5):
        await publish_online(bus, served_sample(f"fb-{index}", "accepted", f"{index}=", seed=index))
    # Every version gated and promoted (margin 1), one checkpoint kept besides protected ones.
    lenient = EvalGateConfig(every_versions=1, num_tasks=4, margin=1.0)
    config = online_trainer_config(
        eval=lenient, max_steps=2, checkpoint_every_steps=1, checkpoint_keep=1
    )
    first = Trainer(config, tmp_path, bus, Publisher(bus.js))
    await first.setup()
    await first.run()
    # Resumed with a gate that demands an improvement of 0.5: nothing more is promoted.
    strict = config.model_copy(
        update={"eval": EvalGateConfig(every_versions=1, num_tasks=4, margin=-0.5), "max_steps": 5}
    )
    second = Trainer(strict, tmp_path, bus, Publisher(bus.js))
    await second.setup()
    await second.run()

    found = await decisions(bus)
    assert [d.promoted for d in found] == [True, True, True, False, False, False]
    serving = found[-1].serving_version
    assert serving == 2  # promoted by the first trainer, at its step 2
    latest = latest_checkpoint(tmp_path / "trainer" / "checkpoints")
    assert latest is not None and latest.state.step == 5
    best = latest.state.best_eval_version
    assert best is not None and latest.state.best_eval_score == max(
        d.candidate_score for d in found if d.version > 0
    )
    kept = {checkpoint_version(p) for p in (tmp_path / "trainer" / "checkpoints").glob("step-*")}
    assert kept == {latest.state.version, serving, best}
    assert len(kept) < 5  # the others were pruned
