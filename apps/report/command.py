"""The `rlpipe report RUN_DIR` subcommand: print the summary, write the plots.

Exit codes: 0 done; 2 no run there (no trainer step recorded), or plots asked for without
matplotlib installed (the summary is printed first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from apps.report.figures import RunFigures, run_figures, summary_lines
from apps.report.plots import MissingMatplotlibError, write_plots
from apps.report.transcripts import transcripts_line

EXIT_OK, EXIT_ERROR = 0, 2


def add_report_parser(commands: Any) -> None:
    """`rlpipe report RUN_DIR [--out DIR] [--no-plots]`."""
    report = commands.add_parser("report", help="plots and a summary of a run's training")
    report.add_argument("run_dir", type=Path, help="the run folder (e.g. runs/<time>)")
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the plots and transcripts.md (default: RUN_DIR/report)",
    )
    report.add_argument("--no-plots", action="store_true", help="print the summary only")


def load_figures(run_dir: Path) -> RunFigures:
    """The run's figures; FileNotFoundError when it recorded no trainer step."""
    figures = run_figures(run_dir)
    if figures is None:
        raise FileNotFoundError(f"{run_dir}: no trainer step recorded (trainer/steps.jsonl)")
    return figures


def plots_line(figures: RunFigures, out_dir: Path) -> str:
    """Write the plots; the line saying where they are."""
    paths = write_plots(figures, out_dir)
    return f"plots: {out_dir}/ ({', '.join(p.name for p in paths)})"


def report_lines(run_dir: Path) -> list[str]:
    """The summary and the plots' line of a finished run (for the demo's last words); the
    plots' line says how to get them when matplotlib is missing."""
    figures = load_figures(run_dir)
    try:
        plots = plots_line(figures, run_dir / "report")
    except MissingMatplotlibError as exc:
        plots = f"plots: none ({exc})"
    transcripts = transcripts_line(run_dir, run_dir / "report")
    return [*summary_lines(figures), plots, *([transcripts] if transcripts else [])]


def run(args: argparse.Namespace) -> int:
    try:
        figures = load_figures(args.run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print("\n".join(summary_lines(figures)), flush=True)
    transcripts = transcripts_line(args.run_dir, args.out or args.run_dir / "report")
    if transcripts:
        print(transcripts, flush=True)
    if args.no_plots:
        return EXIT_OK
    try:
        print(plots_line(figures, args.out or args.run_dir / "report"))
    except MissingMatplotlibError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
