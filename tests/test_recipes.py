"""Recipes are files: the demo's runs are TOML recipes (libs/domains/<name>/recipe.toml, the GPU
loop's libs/domains/arith/gpu.toml) that reach every service through RLPIPE_CONFIG.

Run: .venv/bin/python -m pytest tests/test_recipes.py -q
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from apps.cli import main, settings_classes
from apps.config_cli import check_services
from apps.launcher.arguments import add_demo_arguments, options_from_args
from apps.launcher.harness import harness_tables
from apps.launcher.recipe import RecipeError, load_recipe, merge_tables, recipe_in_use, toml_text
from apps.launcher.run import LaunchOptions, run_local, service_spec
from apps.ray_deploy.cli import recipe_variables
from apps.ray_deploy.plan import build_plan
from libs.chat.template import chat_template_for
from libs.domains.registry import harness_for
from libs.settings import CONFIG_VARIABLE, OVERRIDES_VARIABLE, load_settings
from libs.tokenizer import load_tokenizer
from services.env_gateway.settings import EnvGatewaySettings
from services.rollout_worker.settings import RolloutWorkerSettings
from services.trainer.settings import TrainerSettings
from tests.signing_support import signing_environment
from tests.test_launcher import fake_commands, last_json_line

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "libs" / "domains").glob("*/*.toml"))
PY = sys.executable


def demo_options(run_dir: Path, *flags: str) -> LaunchOptions:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return options_from_args(parser.parse_args(["--run-dir", str(run_dir), *flags]))


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RLPIPE_"):
            monkeypatch.delenv(name)
    for name, value in signing_environment().items():  # as deployed: keys configured
        monkeypatch.setenv(name, value)


def test_the_calc_demo_reads_its_recipe_file_into_every_service(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / "libs" / "domains" / "calc" / "recipe.toml")
    options = demo_options(tmp_path, "--env", "calc", "--no-warm-start")
    with recipe_in_use(options.recipe):
        trainer, gateway = load_settings(TrainerSettings), load_settings(EnvGatewaySettings)
    assert trainer.batch_groups == recipe.tables["trainer"]["batch_groups"] == 2
    assert (trainer.eval.env, trainer.eval.num_tasks) == ("calc", 4)
    assert (gateway.env, gateway.group_size) == ("calc", 4)
    assert options.warm_start is None, "--no-warm-start"


def test_rl_from_the_warm_start_applies_the_recipes_rl_tables(tmp_path: Path) -> None:
    options = demo_options(tmp_path, "--env", "recall")
    assert options.warm_start is not None and options.warm_start.env == "recall"
    assert options.warm_start.recipe.steps == 1100
    with recipe_in_use(options.recipe):
        trainer, gateway = load_settings(TrainerSettings), load_settings(EnvGatewaySettings)
    assert (trainer.learning_rate, trainer.kl_coef) == (1e-4, 0.2)
    assert trainer.learning_rate_decay_steps == 1000
    assert gateway.group_size == 8, "[warm_start.rl.env_gateway] over [env_gateway]"


def test_variables_and_overrides_win_over_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = demo_options(tmp_path, "--env", "calc", "--no-warm-start")
    monkeypatch.setenv("RLPIPE_TRAINER_BATCH_GROUPS", "3")
    monkeypatch.setenv(OVERRIDES_VARIABLE, json.dumps({"env-gateway": {"group_size": 6}}))
    with recipe_in_use(options.recipe):
        assert load_settings(TrainerSettings).batch_groups == 3
        assert load_settings(EnvGatewaySettings).group_size == 6
    assert CONFIG_VARIABLE not in os.environ, "the launcher's own environment is left as it was"


def test_a_file_named_by_rlpipe_config_is_layered_over_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text("[trainer]\nbatch_groups = 5\n")
    monkeypatch.setenv(CONFIG_VARIABLE, str(mine))
    with recipe_in_use(demo_options(tmp_path, "--env", "calc", "--no-warm-start").recipe):
        trainer = load_settings(TrainerSettings)
    assert (trainer.batch_groups, trainer.eval.env) == (5, "calc")
    assert os.environ[CONFIG_VARIABLE] == str(mine)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_is_valid_for_every_service(path: Path, tmp_path: Path) -> None:
    flags = ["--recipe", str(path), "--no-warm-start"]
    if path.parent.name == "dataset":  # its file comes from --dataset
        (tmp_path / "rows.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
        flags += ["--dataset", str(tmp_path / "rows.jsonl")]
    options = demo_options(tmp_path / "run", *flags)
    with recipe_in_use(options.recipe):
        check_services(settings_classes(), options.services)  # raises SettingsError
        written = Path(os.environ[CONFIG_VARIABLE]).read_text()
    assert tomllib.loads(written) == dict(options.recipe), "written as it is"


def test_a_typo_in_a_recipe_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[env_gateway]\nenv = "calc"\n\n[trainer]\nbatch_grups = 2\n')
    run_dir = tmp_path / "run"
    assert main(["demo", "--recipe", str(recipe), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "unknown TOML key trainer.batch_grups (did you mean batch_groups?)" in err
    assert not run_dir.exists(), "refused before anything started"

    recipe.write_text(
        '[env_gateway]\nenv = "calc"\n\n[warm_start]\nnum_tasks = 4\nerror_rate = 0.1\n'
        "steps = 2\nsteps_per_epoch = 1\n\n[warm_start.rl.trainr]\nkl_coef = 0.2\n"
    )
    assert main(["demo", "--recipe", str(recipe), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "unknown field warm_start.steps_per_epoch" in err
    with pytest.raises(RecipeError, match=r"unknown table \[trainr\]"):
        recipe.write_text("[trainr]\nkl_coef = 0.2\n")
        load_recipe(recipe)

    # arith has no scripted expert to record demonstrations with.
    recipe.write_text(
        '[env_gateway]\nenv = "arith"\n\n[warm_start]\nnum_tasks = 4\nerror_rate = 0.1\nsteps = 2\n'
    )
    assert main(["demo", "--recipe", str(recipe), "--run-dir", str(run_dir)]) == 2
    assert "a [warm_start] needs a domain with a scripted expert" in capsys.readouterr().err


def test_a_warm_start_of_an_unknown_preset_is_refused_naming_the_field(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.toml"
    table = (
        '[env_gateway]\nenv = "calc"\n\n[warm_start]\nnum_tasks = 4\nerror_rate = 0.1\nsteps = 2\n'
    )
    recipe.write_text(table + 'preset = "huge"\n')
    refused = r"warm_start\.preset: .*unknown policy preset 'huge'; choose one of \[.*'agent-75m'"
    with pytest.raises(RecipeError, match=refused):
        load_recipe(recipe)
    recipe.write_text(table + 'preset = "agent-75m"\n')
    warm = load_recipe(recipe).warm_start
    assert warm is not None and warm.preset == "agent-75m"
    recipe.write_text(table)
    warm = load_recipe(recipe).warm_start
    assert warm is not None and warm.preset == "tiny", "the default: the tiny policy, on CPU"


def test_a_run_hands_its_recipe_to_every_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trainer here is a stand-in that loads the real trainer settings from what the
    # launcher gave it, prints them and ends (as a trainer ends at its step bound).
    show = (
        "import json; from libs.settings import load_settings; "
        "from services.trainer.settings import TrainerSettings as T; s = load_settings(T); "
        "print(json.dumps({'batch_groups': s.batch_groups, 'max_steps': s.max_steps, "
        "'eval_env': s.eval.env}), flush=True)"
    )
    run_dir = tmp_path / "run"
    options = demo_options(run_dir, "--env", "calc", "--no-warm-start")
    commands = {**fake_commands(), "trainer": [PY, "-c", show]}
    options = LaunchOptions(
        run_dir=run_dir,
        max_trainer_steps=7,
        duration_s=120,
        recipe=options.recipe,
        commands=commands,
        stop_grace_s=5,
    )
    assert run_local(options) == 0, last_json_line(capsys.readouterr().out)
    seen = json.loads((run_dir / "logs" / "trainer.log").read_text().strip().splitlines()[-1])
    assert seen == {"batch_groups": 2, "max_steps": 7, "eval_env": "calc"}
    spec, _ = service_spec("reward", options, "nats://127.0.0.1:4222", run_dir)
    assert spec.env[CONFIG_VARIABLE] == str(run_dir / "recipe.toml")


def test_a_resolved_recipe_is_written_as_toml_it_reads_back() -> None:
    document: dict[str, Any] = {
        "trainer": {"learning_rate": 1e-05, "policy": {"path": '/m/a b"c'}, "eval": {}},
        "env_gateway": {"env": "calc", "tool_latency": "none", "max_ahead_versions": 2},
        "reward": {"weights": [0.5, 1.0], "judge": {"enabled": False}, "odd key": "\x7f é"},
    }
    assert tomllib.loads(toml_text(document)) == document


def test_the_gpu_loops_command_line_parses(tmp_path: Path) -> None:
    options = demo_options(
        tmp_path, "--recipe", str(REPO / "libs" / "domains" / "arith" / "gpu.toml")
    )
    assert options.recipe["trainer"]["policy"] == {"preset": "byte-0.5b", "device": "cuda"}
    assert options.warm_start is None and options.recipe["env_gateway"]["env"] == "arith"


def test_rlpipe_config_checks_a_recipe_file_as_the_services_read_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CONFIG_VARIABLE, str(REPO / "libs" / "domains" / "calc" / "recipe.toml"))
    assert main(["config", "check"]) == 0, capsys.readouterr().err
    # every service's settings read it (7 since the capacity controller): no count kept here
    assert capsys.readouterr().out.startswith("ok: "), "its [warm_start] is the demo's table"


def test_a_ray_deployment_hands_a_recipe_to_every_service() -> None:
    gpu = REPO / "libs" / "domains" / "arith" / "gpu.toml"
    plan = build_plan("nats://a:4222", "/runs/x", env=recipe_variables(gpu))
    assert {s.env[CONFIG_VARIABLE] for s in plan.services} == {str(gpu)}
    with pytest.raises(RecipeError, match=r"\[warm_start\] is built by `rlpipe demo`"):
        recipe_variables(REPO / "libs" / "domains" / "calc" / "recipe.toml")


def test_the_workers_roll_a_domain_out_under_its_harness_limits(tmp_path: Path) -> None:
    # The eval gate rolls recall out under recall's harness (libs.domains): so do the workers,
    # counted in the tokens of the policy they load (here the byte tokenizer of the default).
    options = demo_options(tmp_path, "--env", "recall", "--no-warm-start")
    tables = harness_tables(options.recipe)
    with recipe_in_use(merge_tables(options.recipe, tables)):
        worker = load_settings(RolloutWorkerSettings)
    harness = harness_for("recall", chat_template_for(load_tokenizer("byte")))
    assert worker.max_turns == harness.max_turns == 24
    assert (worker.context_budget_tokens, worker.summary_max_tokens, worker.max_summaries) == (
        harness.context_budget_tokens,
        harness.summary_max_tokens,
        harness.max_summaries,
    )
    assert harness_tables({}) == {}, "a recipe that names no domain leaves the workers as they are"
