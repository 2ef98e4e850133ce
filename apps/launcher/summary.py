"""The summary a launcher run ends with: written to `<run>/summary.json` (one JSON line) and
printed for a person (how the run ended, the training figures and plots of `rlpipe report`,
the services), with the JSON line on stdout when stdout is not a terminal (scripts read it).

Scalar fields of the trainer's last health answer flow in as `trainer_<field>`, so a figure
the trainer starts reporting (a reward mean, say) shows up here without touching this module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from apps.launcher.health import HealthMonitor, HealthRecord
from apps.launcher.supervisor import ChildState, Supervisor, describe_exit

# Health fields that describe the answer itself, not the trainer's progress.
HEALTH_META_FIELDS = ("service", "status", "detail")
# Work counters of a service's last health answer kept in its summary: with several
# rollout-workers, whether each of them did its share.
WORK_FIELDS = ("rollouts_published",)


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
        **{key: record.body[key] for key in WORK_FIELDS if record and key in record.body},
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


def human_lines(summary: dict[str, Any], run_dir: Path) -> list[str]:
    """The summary for a person: how the run ended, what it learned, where things are."""
    lines = [outcome_line(summary)]
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    lines += training_lines(run_dir)
    lines += episode_lines(summary)
    lines.append(services_line(summary.get("services", {})))
    lines.append(f"details: {run_dir / 'summary.json'}, logs in {run_dir / 'logs'}/")
    return lines


def outcome_line(summary: dict[str, Any]) -> str:
    reasons = {
        "max_trainer_steps": "reached its trainer step bound",
        "duration": "reached its duration",
        "signal": "stopped on request",
    }
    reason = str(summary.get("stop_reason") or "")
    how = reasons.get(reason, f"stopped ({reason})" if reason else "ended")
    duration = summary.get("duration_s")
    took = f" after {duration / 60:.1f} min" if isinstance(duration, int | float) else ""
    return f"run {how}{took}, exit code {summary.get('exit_code')}: {summary.get('run_dir')}"


def training_lines(run_dir: Path) -> list[str]:
    """The report's summary and plots (apps.report), or why there is none."""
    from apps.report.command import report_lines

    try:
        return report_lines(run_dir)
    except FileNotFoundError:
        return ["trainer: no step recorded"]


def episode_lines(summary: dict[str, Any]) -> list[str]:
    """Tool environments: the first and last steps' episodes side by side."""
    first, last = summary.get("episodes_first_steps"), summary.get("episodes_last_steps")
    if not isinstance(first, dict) or not isinstance(last, dict):
        return []
    keys = ["success"]
    if last.get("tool_call_validity") is not None:  # the policy called tools
        keys += ["tool_call_validity", "tool_calls_per_episode"]
    if any(e.get("turns_per_episode", 1) != 1 for e in (first, last)):  # multi-turn episodes
        keys += ["turns_per_episode", "segments_per_episode"]
    pairs = [f"{k.replace('_', ' ')} {first.get(k)} -> {last.get(k)}" for k in keys]
    window = summary.get("episode_window_steps")
    return [f"episodes (first vs last {window} steps): " + ", ".join(pairs)]


def services_line(services: dict[str, Any]) -> str:
    healthy = sum(bool(s.get("ever_healthy")) for s in services.values())
    restarts = {name: s["restarts"] for name, s in services.items() if s.get("restarts")}
    restarted = ", ".join(f"{name} {count}" for name, count in restarts.items())
    return f"services: {healthy} of {len(services)} seen healthy; restarts: {restarted or 'none'}"


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """The human summary on a terminal; for a script (stdout not a terminal) the JSON line
    on stdout, the human summary on stderr."""
    text = "\n".join(human_lines(summary, run_dir))
    if sys.stdout.isatty():
        print(text, flush=True)
        return
    print(text, file=sys.stderr, flush=True)
    print(json.dumps(summary), flush=True)
