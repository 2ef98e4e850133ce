"""A run's layout: one rollout-worker per device of `--worker-devices`, each told its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.cli import build_parser
from apps.launcher.arguments import options_from_args
from apps.launcher.run import LaunchOptions, service_spec
from services.rollout_worker.settings import RolloutWorkerSettings


def test_each_worker_of_the_layout_runs_on_its_own_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = build_parser().parse_args(
        ["demo", "--worker-devices", "cuda:2, cuda:3", "--trainer-ranks", "2"]
    )
    options = options_from_args(args)
    workers = [name for name, service in options.instances() if service == "rollout-worker"]
    assert workers == ["rollout-worker", "rollout-worker-2"]
    # The recipe puts the workers on "cuda"; the layout's device wins, worker by worker.
    (tmp_path / "recipe.toml").write_text('[rollout_worker.policy]\ndevice = "cuda"\n')
    devices = []
    for name in workers:
        spec, _ = service_spec("rollout-worker", options, "nats://x", tmp_path, name)
        for variable, value in spec.env.items():
            monkeypatch.setenv(variable, value)
        devices.append(RolloutWorkerSettings().policy.device)  # the variable takes effect
    assert devices == ["cuda:2", "cuda:3"]
    trainer, _ = service_spec("trainer", options, "nats://x", tmp_path)
    assert not any("DEVICE" in variable for variable in trainer.env)


def test_a_worker_count_that_disagrees_with_the_devices_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a worker runs on each device"):
        LaunchOptions(run_dir=tmp_path, rollout_workers=3, worker_devices=("cuda:1", "cuda:2"))
    same = LaunchOptions(run_dir=tmp_path, rollout_workers=2, worker_devices=("cpu", "cpu"))
    assert len(same.instances()) == len(LaunchOptions(run_dir=tmp_path).instances()) + 1
