"""What the launcher shows while it runs: a live view on a terminal, log lines otherwise.

Everything goes to stderr. On a terminal, a rich `Live` view: a header (NATS URL, run
folder, elapsed time), the training line (trainer step of the bound with a progress bar and
ETA, recent reward and success, samples/s, staleness, policy version) and a table of the
services (pid, status, restarts, uptime, policy version and versions behind the trainer for
the workers, detail). Elsewhere, one JSON status line every few seconds with the same figures.
The training figures are the trainer's health answer (libs.trainer.metrics: the last steps).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from apps.launcher.health import HealthMonitor, HealthRecord
from apps.launcher.supervisor import ChildState, Supervisor

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
            # Its own level: the demo keeps library loggers to warnings (apps/cli.py).
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
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


# Below this many columns the services' details go under the table, one line each: beside
# the other columns they would be folded a few characters wide, many lines per service.
WIDE_COLUMNS = 120

# Trainer health fields the view shows, and how: (label, format).
TRAINING_FIGURES = {
    "reward_recent": ("reward", "{:.2f}"),
    "success_recent": ("success", "{:.2f}"),
    "samples_per_s_recent": ("samples/s", "{:.1f}"),
    "staleness_recent": ("staleness", "{:.2f}"),
    "policy_version": ("version", "{}"),
}


def training_figures(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of the trainer's recent figures it has reported (numbers only)."""
    shown = []
    for key, (label, form) in TRAINING_FIGURES.items():
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            shown.append((label, form.format(value)))
    return shown


@dataclass(frozen=True)
class Bound:
    """Where the run stops: a trainer step, a duration, both or neither."""

    max_steps: int | None = None
    duration_s: float | None = None

    def progress(self, step: int, elapsed_s: float) -> float | None:
        """Fraction of the run done (the nearer bound), None when unbounded."""
        fractions = []
        if self.max_steps:
            fractions.append(step / self.max_steps)
        if self.duration_s:
            fractions.append(elapsed_s / self.duration_s)
        return min(max(fractions), 1.0) if fractions else None

    def eta_s(self, step: int, elapsed_s: float, steps_per_s: float | None) -> float | None:
        """Seconds until the nearer bound, from the step rate; None when unknown."""
        left = []
        if self.max_steps and steps_per_s:
            left.append(max(self.max_steps - step, 0) / steps_per_s)
        if self.duration_s:
            left.append(max(self.duration_s - elapsed_s, 0.0))
        return min(left) if left else None


class StepRate:
    """Trainer steps per second, from the steps seen since the first one."""

    def __init__(self) -> None:
        self._first: tuple[int, float] | None = None
        self.steps_per_s: float | None = None

    def observe(self, step: int, now_s: float) -> None:
        if self._first is None or step < self._first[0]:  # a resumed trainer may step back
            self._first = (step, now_s)
            return
        first_step, first_s = self._first
        if step > first_step and now_s > first_s:
            self.steps_per_s = (step - first_step) / (now_s - first_s)


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
        bound: Bound | None = None,
    ) -> None:
        self.log, self.supervisor, self.monitor = log, supervisor, monitor
        self.nats_url, self.run_dir = nats_url, run_dir
        self.log_every_s = log_every_s
        self.bound = bound or Bound()
        self.started_at = time.monotonic()
        self.rate = StepRate()
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
        step = self.trainer_body().get("step")
        if isinstance(step, int) and step > 0:
            self.rate.observe(step, time.monotonic())
        if self._live:
            self._live.update(self.render())
        elif time.monotonic() - self._last_log_at >= self.log_every_s:
            self._log_status()

    def trainer_body(self) -> dict[str, Any]:
        record = self.monitor.records.get("trainer")
        return record.body if record else {}

    def trainer_progress(self) -> dict[str, Any]:
        """The trainer's step, version and recent figures, for the status log line."""
        body = self.trainer_body()
        keys = ("step", "policy_version", *TRAINING_FIGURES)
        progress = {key: body[key] for key in keys if body.get(key) is not None}
        eta = self._eta_s()
        if eta is not None:
            progress["eta_s"] = round(eta)
        return progress

    def _eta_s(self) -> float | None:
        step = self.trainer_body().get("step")
        if not isinstance(step, int):
            return None
        elapsed_s = time.monotonic() - self.started_at
        return self.bound.eta_s(step, elapsed_s, self.rate.steps_per_s)

    def render(self) -> Group:
        return Group(self._header(), self._training(), self._table())

    def _header(self) -> Text:
        elapsed = format_duration(time.monotonic() - self.started_at)
        return Text.assemble(
            ("rlpipe demo  ", "bold"),
            f"nats {self.nats_url}  ",
            f"run {self.run_dir}  ",
            f"elapsed {elapsed}",
        )

    def _training(self) -> Table:
        """trainer step 97/300 [bar] 32%  ETA 2m10s  reward 0.84  samples/s 85.2  ..."""
        body = self.trainer_body()
        step = body.get("step")
        line = Table.grid(padding=(0, 1))
        if not isinstance(step, int):
            line.add_row(Text("trainer: waiting for its first answer", "dim"))
            return line
        bound = f"/{self.bound.max_steps}" if self.bound.max_steps else ""
        cells: list[Any] = [Text(f"trainer step {step}{bound}", "bold cyan")]
        progress = self.bound.progress(step, time.monotonic() - self.started_at)
        if progress is not None:
            cells += [ProgressBar(total=1.0, completed=progress, width=24), f"{progress:.0%}"]
            cells.append(f"ETA {format_duration(self._eta_s())}")
        # The step, bar, percentage and ETA keep their width; the figures take what is left
        # and wrap onto more lines on a narrow terminal (80 columns).
        for _ in cells:
            line.add_column(no_wrap=True)
        line.add_column(ratio=1)
        figures = Text("  ").join(
            Text.assemble((f"{label} ", "dim"), value) for label, value in training_figures(body)
        )
        line.add_row(*cells, figures)
        return line

    def _table(self) -> Group:
        """One row per service; the detail column where the terminal is wide enough, else
        one line per service with something to say, under the table."""
        wide = self.log.console.width >= WIDE_COLUMNS
        table = Table(expand=True)
        for column in ("service", "pid", "status", "restarts", "uptime", "version"):
            table.add_column(column, no_wrap=True)
        if wide:
            table.add_column("detail", overflow="fold")
        details = []
        for name, child in self.supervisor.children.items():
            record = self.monitor.records.get(name)
            status, detail = service_status(child, record)
            row: list[str | Text] = [
                name,
                str(child.pid or "-"),
                Text(status, STATUS_STYLES.get(status, "")),
                str(child.restarts),
                format_duration(child.uptime_s),
                self._version(name, record),
            ]
            table.add_row(*row, *([detail] if wide else []))
            if not wide and detail:
                details.append(Text(f"{name}: {detail}", no_wrap=True, overflow="ellipsis"))
        return Group(table, *details)

    def _version(self, name: str, record: HealthRecord | None) -> str:
        """The policy version a service holds; for a worker, how far behind the trainer."""
        version = record.body.get("policy_version") if record else None
        if not isinstance(version, int):
            return "-"
        behind = self.versions_behind().get(name)
        return f"v{version}" if behind is None else f"v{version} ({behind} behind)"

    def versions_behind(self) -> dict[str, int]:
        """Versions each service holding a policy is behind the trainer's (the workers)."""
        trainer = self.trainer_body().get("policy_version")
        behind = {}
        for name, record in self.monitor.records.items():
            version = record.body.get("policy_version")
            if name != "trainer" and isinstance(trainer, int) and isinstance(version, int):
                behind[name] = max(trainer - version, 0)
        return behind

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
            versions_behind=self.versions_behind(),
            **self.trainer_progress(),
        )
