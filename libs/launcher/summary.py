"""The one-line JSON summary a launcher run ends with (also written to `<run>/summary.json`).

Scalar fields of the trainer's last health answer flow in as `trainer_<field>`, so a figure
the trainer starts reporting (a reward mean, say) shows up here without touching this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.launcher.health import HealthMonitor, HealthRecord
from libs.launcher.supervisor import ChildState, Supervisor, describe_exit

# Health fields that describe the answer itself, not the trainer's progress.
HEALTH_META_FIELDS = ("service", "status", "detail")


def trainer_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`{"step": 12, "reward_mean": 0.4}` -> `{"trainer_step": 12, "trainer_reward_mean": 0.4}`."""
    return {
        f"trainer_{key}": value
        for key, value in body.items()
        if key not in HEALTH_META_FIELDS and isinstance(value, int | float | str | bool)
    }


def service_summary(child: ChildState | None, record: HealthRecord | None) -> dict[str, Any]:
    """Restarts, final process state, last exit, and whether it was ever healthy."""
    if child is None:
        return {"restarts": 0, "final_status": "not_started", "ever_healthy": False}
    code = child.last_exit_code
    return {
        "restarts": child.restarts,
        "final_status": child.state,
        "exit": describe_exit(code) if code is not None else None,
        "ever_healthy": bool(record and record.ever_healthy),
        "last_health": record.status if record else None,
        "pids": child.pids,
        "log": str(child.log_path),
    }


def build_summary(
    run_dir: Path,
    services: list[str],
    supervisor: Supervisor | None,
    monitor: HealthMonitor | None,
    **fields: Any,
) -> dict[str, Any]:
    """The summary of a run: `fields` (exit code, duration, ...) then trainer figures, services."""
    children = supervisor.children if supervisor else {}
    records = monitor.records if monitor else {}
    per_service = {n: service_summary(children.get(n), records.get(n)) for n in services}
    trainer = records.get("trainer")
    summary: dict[str, Any] = {"run_dir": str(run_dir), **fields, "trainer_step": None}
    summary.update(trainer_fields(trainer.body) if trainer else {})
    summary["all_services_seen_healthy"] = all(s["ever_healthy"] for s in per_service.values())
    summary["services"] = per_service
    return summary
