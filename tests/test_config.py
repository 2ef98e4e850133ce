"""Configuration through the real commands: `rlpipe config show|check`, `--set`, typos refused
with the nearest field, a bad value or an unreachable NATS as one line and exit 2.

Run: .venv/bin/python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.cli import main, settings_classes
from apps.config_cli import dotted_fields
from libs.nats_server import free_port
from libs.settings import SettingsError, load_settings, nested_fields
from services.trainer.settings import TrainerSettings
from tests.signing_support import signing_environment


def rlpipe(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    clean |= signing_environment()  # as deployed: the weight-signing keys are configured
    return subprocess.run(
        [sys.executable, "-m", "apps.cli", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rlpipe_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str, **env: str
) -> tuple[int, str, str]:
    """`rlpipe ARGS` run by the CLI's main in this process (no interpreter to start), with
    `env` (and the weight-signing keys) as the only RLPIPE_* variables; (exit code, stdout,
    stderr)."""
    for name in [n for n in os.environ if n.startswith("RLPIPE_")]:
        monkeypatch.delenv(name)
    # --set writes RLPIPE_SET into this process's environment. Set, then deleted, so that the
    # undo removes it: a delenv of an absent name records nothing, and the leaked overrides
    # (trainer.learning_rate=1e-4) reached every later test's services.
    monkeypatch.setenv("RLPIPE_SET", "{}")
    monkeypatch.delenv("RLPIPE_SET")
    for name, value in (signing_environment() | env).items():
        monkeypatch.setenv(name, value)
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_typos_in_variables_and_toml_name_the_nearest_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "rlpipe.toml"
    config.write_text("[trainer]\nlearnin_rate = 0.1\n[reward]\nbatch_size = 8\n[trainr]\nx = 1\n")
    env = {
        "RLPIPE_CONFIG": str(config),
        "RLPIPE_TRAINER_LEARNIN_RATE": "5",
        "RLPIPE_ROLLOUT_WORKER_POLICY_PAHT": "models/x",
        "RLPIPE_NATS_ULR": "nats://x:4222",
    }
    code, out, err = rlpipe_here(monkeypatch, capsys, "config", "check", **env)
    assert code == 2, out
    errors = set(err.splitlines())
    assert errors == {
        "error: trainer: unknown variable RLPIPE_TRAINER_LEARNIN_RATE "
        "(did you mean learning_rate?)",
        "error: trainer: unknown TOML key trainer.learnin_rate (did you mean learning_rate?)",
        "error: rollout-worker: unknown variable RLPIPE_ROLLOUT_WORKER_POLICY_PAHT "
        "(did you mean policy.path?)",
        "error: unknown variable RLPIPE_NATS_ULR: no service reads it "
        "(did you mean RLPIPE_NATS_URL?)",
        f"error: unknown TOML table [trainr] in {config} (did you mean trainer?)",
    }, err

    config.write_text("[trainer]\nlearning_rate = 0.1\n[reward]\nbatch_size = 8\n")
    code, out, err = rlpipe_here(monkeypatch, capsys, "config", "check", RLPIPE_CONFIG=str(config))
    assert code == 0, err
    assert out.startswith("ok: 7 services")


def test_check_accepts_the_deployment_variables_the_docs_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/domains.md has a user point RLPIPE_DOMAIN_PATHS at a folder of domains; compose
    # reads RLPIPE_NATS_CONFIG to pick the server's configuration.
    env = {"RLPIPE_DOMAIN_PATHS": str(tmp_path), "RLPIPE_NATS_CONFIG": "cluster.conf"}
    code, out, err = rlpipe_here(monkeypatch, capsys, "config", "check", **env)
    assert code == 0, err
    assert out.startswith("ok: 7 services")


def test_show_gives_every_field_with_its_value_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "rlpipe.toml"
    config.write_text(
        "[trainer]\nbatch_groups = 4\nmax_staleness = 2\n[trainer.policy]\nseed = 7\n"
    )
    env = {
        "RLPIPE_CONFIG": str(config),
        "RLPIPE_TRAINER_MAX_STALENESS": "3",
        "RLPIPE_NATS_URL": "nats://shared:4222",
    }
    override = ("--set", "trainer.learning_rate=1e-4")
    code, out, err = rlpipe_here(
        monkeypatch, capsys, "config", "show", "trainer", "--json", *override, **env
    )
    assert code == 0, err
    rows = {row["field"]: row for row in map(json.loads, out.splitlines())}
    nested = nested_fields(TrainerSettings)
    assert set(rows) == {*TrainerSettings.model_fields} - set(nested) | {
        f"{name}.{sub}" for name, model in nested.items() for sub in model.model_fields
    }
    assert rows["learning_rate"] | {"description": ""} == {
        "field": "learning_rate",
        "type": "float | None",  # unset: chosen by model size when the trainer starts
        "default": None,
        "value": 1e-4,
        "source": "--set",
        "description": "",
    }
    assert (rows["max_staleness"]["value"], rows["max_staleness"]["source"]) == (
        3,
        "env RLPIPE_TRAINER_MAX_STALENESS",  # the variable wins over the TOML file
    )
    assert (rows["batch_groups"]["value"], rows["batch_groups"]["source"]) == (4, f"TOML {config}")
    assert (rows["policy.seed"]["value"], rows["policy.seed"]["source"]) == (7, f"TOML {config}")
    assert rows["nats_url"]["source"] == "env RLPIPE_NATS_URL"
    assert (rows["weight_decay"]["value"], rows["weight_decay"]["source"]) == (0.0, "default")
    assert rows["max_steps"]["type"] == "int | None"

    code, out, err = rlpipe_here(monkeypatch, capsys, "config", "show", "trainer", *override, **env)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("learning_rate "))
    assert line.split() == ["learning_rate", "float", "|", "None", "null", "0.0001", "--set"]


def test_the_demo_refuses_a_bad_value_before_starting_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {"RLPIPE_REWARD_BATCH_SIZE": "many"}
    result = rlpipe("demo", "--set", "trainer.learning_rate=-1", "--run-dir", str(run_dir), env=env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: trainer.learning_rate = '-1': Input should be greater than 0 (--set)",
        "error: reward.batch_size = 'many': Input should be a valid integer, unable to parse "
        "string as an integer (env RLPIPE_REWARD_BATCH_SIZE)",
    ]
    assert not run_dir.exists()


def test_the_demo_refuses_skipped_groups_with_the_sync_feeder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = ["trainer.zero_variance_groups=skip", "env-gateway.feeder.mode=sync"]
    result = rlpipe("demo", *[f"--set={s}" for s in sets], "--run-dir", str(run_dir))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: trainer.zero_variance_groups=skip needs env-gateway feeder.mode async: the "
        "sync feeder publishes only batch_groups tasks a version, none for skipped groups"
    ]
    assert not run_dir.exists()


def test_a_bad_value_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = rlpipe("run", "reward", env={"RLPIPE_REWARD_BATCH_SIZE": "many"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: reward.batch_size = 'many': Input should be a valid integer, unable to parse "
        "string as an integer (env RLPIPE_REWARD_BATCH_SIZE)"
    ]
    # A misspelt override is refused before the service is even imported.
    code, _, err = rlpipe_here(
        monkeypatch, capsys, "run", "trainer", "--set", "trainer.learnin_rate=1"
    )
    assert code == 2
    assert err.splitlines() == [
        "error: --set trainer.learnin_rate: no such field (did you mean learning_rate?)"
    ]


def test_an_unreachable_nats_is_one_error_line(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    env = {"RLPIPE_NATS_URL": url, "RLPIPE_REWARD_HTTP_PORT": "0", "RLPIPE_LOG_FORMAT": "json"}
    result = rlpipe("run", "reward", env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines()]
    problems = [e for e in events if e["level"] in ("warning", "error")]
    assert [e["event"] for e in problems] == ["cannot start"], problems
    assert f"could not connect to NATS at {url} after 2 attempts" in problems[0]["error"]
    assert events[0]["event"] == "starting"


def test_overrides_win_over_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_TRAINER_LEARNING_RATE", "0.5")
    monkeypatch.setenv("RLPIPE_SET", json.dumps({"trainer": {"learning_rate": "1e-4"}}))
    assert load_settings(TrainerSettings).learning_rate == 1e-4
    monkeypatch.setenv("RLPIPE_SET", json.dumps({"trainer": {"policy": {"seeed": 1}}}))
    with pytest.raises(SettingsError, match=r"policy\.seeed"):
        load_settings(TrainerSettings)


def test_an_engine_that_is_not_built_is_refused_where_it_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "rlpipe.toml"
    config.write_text('[rollout_worker.engine]\ntype = "vllm"\n')
    code, out, err = rlpipe_here(monkeypatch, capsys, "config", "check", RLPIPE_CONFIG=str(config))
    assert code == 2, out
    assert err.splitlines() == [
        "error: rollout-worker.engine.type = 'vllm': Input should be 'hf', 'paged' or 'remote' "
        f"(TOML {config})"
    ]


def test_the_configuration_reference_is_current_and_documents_every_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, page, err = rlpipe_here(monkeypatch, capsys, "config", "reference")
    assert code == 0, err
    committed = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert page == committed, "stale: run `rlpipe config reference > docs/configuration.md`"
    for service, load in settings_classes().items():
        cls = load()
        assert f"## {service}\n" in page
        rows = page.split(f"## {service}\n")[1].split("\n## ")[0].splitlines()
        fields = {row.split("`")[1]: row for row in rows if row.startswith("| `")}
        assert set(fields) == set(dotted_fields(cls)) - set(nested_fields(cls)), service
        undocumented = [name for name, row in fields.items() if row.endswith("|  |")]
        assert not undocumented, f"{service}: fields without a description: {undocumented}"
