"""What the launcher shows while it runs: a live table on a terminal, log lines otherwise.

Everything goes to stderr, so stdout carries only the final JSON summary line. On a
terminal, a rich `Live` table (service, pid, status, restarts, uptime, detail) under a
header with the NATS URL, run folder, elapsed time and the trainer's step and policy version;
elsewhere, one JSON status line every few seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from libs.launcher.health import HealthMonitor, HealthRecord
from libs.launcher.supervisor import ChildState, Supervisor

STATUS_STYLES = {
    "ok": "green",
    "idle": "cyan",
    "starting": "yellow",
    "degraded": "red",
    "backoff": "red",
    "failed": "bold red",
    "unreachable": "red",
}


class LauncherLog:
    """The launcher's own event lines: colored on a terminal, JSON on anything else."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._json = structlog.wrap_logger(
            structlog.PrintLogger(sys.stderr),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(),
            ],
        ).bind(service="launcher")

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if not self.console.is_terminal:
            getattr(self._json, level)(event, **fields)
            return
        style = "bold red" if level == "error" else "bold"
        pairs = " ".join(f"{key}={value}" for key, value in fields.items())
        self.console.print(
            Text.assemble((time.strftime("%H:%M:%S "), "dim"), (event, style), " ", pairs)
        )


def format_duration(seconds: float | None) -> str:
    """61.2 -> "1m01s"; None -> "-"."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def service_status(child: ChildState, record: HealthRecord | None) -> tuple[str, str]:
    """(status, detail) to show: the service's own word while it runs, else its process state."""
    if child.state != "running" or record is None:
        return child.state, child.detail
    if record.status == "unknown" or (record.status == "unreachable" and not record.ever_healthy):
        return "starting", record.detail
    return record.status, record.detail


class StatusView:
    """Shows the run while it lasts; call `refresh()` often, inside `with view:`."""

    def __init__(
        self,
        log: LauncherLog,
        supervisor: Supervisor,
        monitor: HealthMonitor,
        nats_url: str,
        run_dir: Path,
        log_every_s: float = 5.0,
    ) -> None:
        self.log, self.supervisor, self.monitor = log, supervisor, monitor
        self.nats_url, self.run_dir = nats_url, run_dir
        self.log_every_s = log_every_s
        self.started_at = time.monotonic()
        self._last_log_at = 0.0
        self._live: Live | None = None

    def __enter__(self) -> StatusView:
        if self.log.console.is_terminal:
            self._live = Live(self.render(), console=self.log.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live:
            self._live.update(self.render())
            self._live.__exit__(exc_type, exc, tb)
            self._live = None
        else:
            self._log_status()

    def refresh(self) -> None:
        if self._live:
            self._live.update(self.render())
        elif time.monotonic() - self._last_log_at >= self.log_every_s:
            self._log_status()

    def trainer_progress(self) -> dict[str, Any]:
        record = self.monitor.records.get("trainer")
        body = record.body if record else {}
        return {key: body[key] for key in ("step", "policy_version") if key in body}

    def render(self) -> Group:
        return Group(self._header(), self._table())

    def _header(self) -> Text:
        elapsed = format_duration(time.monotonic() - self.started_at)
        progress = "  ".join(f"{k}={v}" for k, v in self.trainer_progress().items())
        return Text.assemble(
            ("rlpipe demo  ", "bold"),
            f"nats {self.nats_url}  ",
            f"run {self.run_dir}  ",
            f"elapsed {elapsed}  ",
            (f"trainer {progress}" if progress else "", "bold cyan"),
        )

    def _table(self) -> Table:
        table = Table(expand=True)
        for column in ("service", "pid", "status", "restarts", "uptime"):
            table.add_column(column, no_wrap=True)
        table.add_column("detail", overflow="fold")
        for name, child in self.supervisor.children.items():
            status, detail = service_status(child, self.monitor.records.get(name))
            table.add_row(
                name,
                str(child.pid or "-"),
                Text(status, STATUS_STYLES.get(status, "")),
                str(child.restarts),
                format_duration(child.uptime_s),
                detail,
            )
        return table

    def _log_status(self) -> None:
        self._last_log_at = time.monotonic()
        services = {
            name: service_status(child, self.monitor.records.get(name))[0]
            for name, child in self.supervisor.children.items()
        }
        restarts = {name: c.restarts for name, c in self.supervisor.children.items() if c.restarts}
        elapsed_s = round(time.monotonic() - self.started_at, 1)
        self.log.info(
            "status",
            elapsed_s=elapsed_s,
            services=services,
            restarts=restarts,
            **self.trainer_progress(),
        )
