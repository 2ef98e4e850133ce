"""Domains: the registry finds each built-in in its folder; a domain of your own is one folder
that env-gateway serves and feeds and reward scores, nothing else touched; the eval gate rolls
recall out under the harness limits the workers roll it out with."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
import torch

from apps import domains_cli
from apps.cli import build_parser
from apps.launcher.harness import harness_tables
from apps.launcher.recipe import load_recipe
from libs.bus import wire
from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.chat.template import chat_template_for
from libs.chat.tool_calls import format_tool_call
from libs.domains import registry
from libs.domains.domain import Domain
from libs.domains.recall.env import TOOL_NAME
from libs.engine.base import Completion, InferenceEngine, SamplingParams
from libs.envs.client import EnvClient
from libs.envs.feeder import FeederConfig
from libs.envs.server import EnvServer, ServerLimits
from libs.policy import PolicyConfig
from libs.rollout.agent import SUMMARY_REQUEST, AgentRunner, AgentSettings
from libs.rollout.episode import RunnerSettings
from libs.tokenizer import ByteTokenizer
from libs.trainer.eval_gate import EvalGate, EvalGateConfig
from proto import messages as m
from proto import streams, subjects
from proto.messages import ScoredRollout, Task
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout_worker.settings import RolloutWorkerSettings
from tests.conftest import wait_for

TOKENIZER = ByteTokenizer()
TEMPLATE = chat_template_for(TOKENIZER)
BUILTINS = {"arith", "calc", "coding", "dataset", "functions", "recall"}

# A domain as a user writes it: a folder of its own (env, rubric, harness limits), nothing else.
EXAMPLE_DOMAIN = Path(__file__).resolve().parent.parent / "examples" / "domains" / "echo"


def toy_domain(tmp_path: Path) -> Path:
    """The example domain, copied into a folder made in tmp_path."""
    return Path(shutil.copytree(EXAMPLE_DOMAIN, tmp_path / "echo"))


def write_domain(folder: Path, files: Mapping[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_every_builtin_domain_is_found_in_its_own_folder() -> None:
    found = registry.domains()
    assert set(found) >= BUILTINS
    for name in BUILTINS:
        domain = found[name]
        assert domain.folder == registry.BUILTIN_DIR / name
        assert domain.recipe_path == domain.folder / "recipe.toml"
        assert registry.make_env(name).name == name
        assert registry.rubric_for(name).criteria
    assert {n for n in BUILTINS if found[n].expert is not None} == {"calc", "functions", "recall"}


def test_a_domain_needs_no_recipe_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = toy_domain(tmp_path)
    monkeypatch.setenv(registry.DOMAIN_PATHS_VAR, str(folder))
    echo = registry.domain("echo")
    assert echo.folder == folder and not echo.recipe_path.exists()
    assert registry.harness_for("echo", TEMPLATE).max_turns == 1


def test_a_folder_that_is_no_domain_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_domain(tmp_path / "empty", {"__init__.py": '"""Nothing here."""\n'})
    monkeypatch.setenv(registry.DOMAIN_PATHS_VAR, str(folder))
    with pytest.raises(ValueError, match=r"empty defines no DOMAIN"):
        registry.domains()
    monkeypatch.setenv(registry.DOMAIN_PATHS_VAR, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"missing: no __init__.py"):
        registry.domains()


def test_rlpipe_domain_list_shows_a_folder_of_your_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(registry.DOMAIN_PATHS_VAR, str(EXAMPLE_DOMAIN))
    assert domains_cli.run(build_parser().parse_args(["domain", "list"])) == 0
    lines = {line.split("\t")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == BUILTINS | {"echo"}
    assert "expert=no" in lines["echo"] and "recipe=-" in lines["echo"]
    assert "expert=yes" in lines["recall"]


def test_an_unknown_domain_names_the_known_ones_and_the_way_to_add_one() -> None:
    with pytest.raises(registry.UnknownDomainError, match=r"known: .*recall.*RLPIPE_DOMAIN_PATHS"):
        registry.domain("chess")


@pytest.fixture
async def echo_services(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[None]:
    """env-gateway feeding echo tasks and reward scoring them, the domain a folder in
    tmp_path named by RLPIPE_DOMAIN_PATHS."""
    monkeypatch.setenv(registry.DOMAIN_PATHS_VAR, str(toy_domain(tmp_path)))
    await provision(bus.js)
    feeder = FeederConfig(mode="async", queue_depth_tasks=2, max_ahead_versions=None)
    services = [
        EnvGatewayService(EnvGatewaySettings(env="echo", group_size=1, feeder=feeder)),
        RewardService(RewardSettings(fetch_timeout_s=0.2)),
    ]
    for service in services:
        await service.start(bus)
    running = [asyncio.create_task(service.run()) for service in services]
    yield
    for service in services:
        await service.stop()
    await asyncio.wait_for(asyncio.gather(*running), timeout=30)


async def first_task(bus: Bus) -> Task:
    await wait_for(lambda: has_messages(bus, streams.TASKS.name), what="a task fed")
    raw = await bus.js.get_msg(streams.TASKS.name, seq=1)
    return wire.decode(Task, raw.data or b"", raw.headers)


async def has_messages(bus: Bus, stream: str) -> bool:
    return (await bus.js.stream_info(stream)).state.messages > 0


async def test_a_domain_from_a_folder_is_fed_served_and_scored(
    bus: Bus, echo_services: None
) -> None:
    task = await first_task(bus)
    assert (task.env, task.prompt) == ("echo", "Say apple.")

    async def say_apple(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        ids = [*TOKENIZER.encode("apple"), TOKENIZER.eos_id]
        return [Completion(0, 0, ids, [-1.0] * len(ids), [-1.0] * len(ids), "stop", 0)]

    agent = registry.harness_for("echo", TEMPLATE)
    settings = RunnerSettings(worker_id="w")
    runner = AgentRunner(EnvClient(bus.nc), TOKENIZER, say_apple, settings, agent)
    (rollout,) = await runner.run(task)
    assert rollout.env_info == {"said_it": True}
    publisher = Publisher(bus.js)
    await publisher.publish(
        subjects.rollout_raw_subject("echo"), rollout, msg_id=rollout.rollout_id
    )

    await wait_for(lambda: has_messages(bus, streams.ROLLOUTS_SCORED.name), what="scored")
    raw = await bus.js.get_msg(streams.ROLLOUTS_SCORED.name, seq=1)
    scored = wire.decode(ScoredRollout, raw.data or b"", raw.headers)
    assert scored.scored and scored.reward == 1.0
    assert [(c.name, c.reason) for c in scored.criteria] == [("said_it", "said the word")]


async def test_a_domain_whose_env_is_a_process_of_its_own_is_left_to_that_process(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # examples/external_env.py serves `notes` over the wire protocol; its domain brings the
    # rubric, and env-gateway must not answer on the same subjects.
    notes = Domain("notes", EXAMPLE_DOMAIN, None, registry.domain("arith").rubric)
    monkeypatch.setitem(registry._REGISTERED, "notes", notes)
    assert registry.rubric_for("notes").criteria
    with pytest.raises(ValueError, match="a process of its own"):
        registry.make_env("notes")
    await provision(bus.js)
    gateway = EnvGatewayService(EnvGatewaySettings(feeder=FeederConfig(mode="off")))
    await gateway.start(bus)
    try:
        assert "notes" not in gateway.detail and "recall" in gateway.detail
    finally:
        await gateway.stop()


class CodeReader(InferenceEngine):
    """A scripted recall policy: reads every digit with the tool, keeps the digits read in
    its summaries, then answers the code. It sees only what a policy sees: its context."""

    @property
    def policy_version(self) -> int:
        return 0

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        return 0.0

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[Completion]:
        texts = [self.turn(TOKENIZER.decode(prompt)) for prompt in prompts]
        return [
            Completion(i, 0, ids, [-1.0] * len(ids), [-1.0] * len(ids), "stop", 0)
            for i, ids in enumerate([*TOKENIZER.encode(text), TOKENIZER.eos_id] for text in texts)
        ]

    @staticmethod
    def turn(context: str) -> str:
        summarized = re.findall(r"Digits read: (\d*)", context)
        reveals = re.findall(r"digit (\d+) of (\d+): (\d)", context)
        digits = (summarized[-1] if summarized else "") + "".join(d for _, _, d in reveals)
        if SUMMARY_REQUEST in context:  # only a segment that is asked to summarize has it
            return f"Digits read: {digits}"
        if reveals and reveals[-1][0] == reveals[-1][1]:
            return digits
        return format_tool_call(TOOL_NAME, {})


async def test_the_recall_gate_rolls_out_under_the_workers_harness(bus: Bus) -> None:
    await provision(bus.js)
    config = EvalGateConfig(every_versions=1, num_tasks=2, env="recall")
    gate = EvalGate(config, PolicyConfig(preset="tiny"), TOKENIZER, EnvClient(bus.nc))
    engine = CodeReader()

    # The workers' limits: the rollout-worker settings the demo gives recall's workers (its
    # recipe with --no-warm-start: the embedded policy, the byte tokenizer, as the gate's).
    recipe = load_recipe(registry.domain("recall").recipe_path).tables
    workers = RolloutWorkerSettings(**harness_tables(recipe)["rollout_worker"])
    limits = {name: getattr(workers, name) for name in AgentSettings.model_fields}
    assert gate.harness(engine).model_dump() == limits
    assert limits["max_turns"] > 8 and limits["context_budget_tokens"] < 4096

    server = EnvServer(bus.nc, {"recall": registry.make_env("recall")}, ServerLimits())
    await server.start()
    try:
        scored = await gate.held_out_episodes(engine)
    finally:
        await server.stop()
    assert len(scored) == 2
    for sample in scored:
        rollout = sample.rollout
        # Six reveals do not fit in one segment of the workers' budget: the episode went on
        # through summaries, and what they carried made the answer right.
        assert rollout.stats[m.EPISODE_STAT_SEGMENTS] >= 2
        assert rollout.env_info["answer_correct"], rollout.env_info
        assert sample.reward == 1.0
