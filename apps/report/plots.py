"""The run's PNG plots, drawn with matplotlib (the `report` extra) without pyplot's state.

    paths = write_plots(figures, out_dir)    # reward.png, staleness.png, throughput.png, ...

Each plot shows the per-step values faintly and their rolling mean over `SMOOTH` steps.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.report.figures import RunFigures
from libs.trainer.metrics import StepRecord, mean_staleness

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Steps in the rolling mean drawn over each series.
SMOOTH = 10
INSTALL_LINE = "plots need matplotlib: pip install 'rlpipe[report]' (or use --no-plots)"


class MissingMatplotlibError(RuntimeError):
    """The `report` extra is not installed."""


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingMatplotlibError(INSTALL_LINE)


def rolling(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plots(figures: RunFigures, out_dir: Path) -> list[Path]:
    """Draw every plot of the run's offline steps into `out_dir`; the paths written."""
    require_matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers: dict[str, Callable[[RunFigures], Figure]] = {
        "reward": reward_plot,
        "staleness": staleness_plot,
        "throughput": throughput_plot,
        "mismatch": mismatch_plot,
        "training": training_plot,
    }
    if any(r.turns_per_episode is not None for r in figures.steps):
        drawers["episodes"] = episodes_plot
    paths = []
    for name, draw in drawers.items():
        path = out_dir / f"{name}.png"
        draw(figures).savefig(path, dpi=100)
        paths.append(path)
    return paths


def new_figure(title: str, columns: int) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * columns, 4.2), layout="constrained")
    axes = figure.subplots(1, columns, squeeze=False)[0]
    figure.suptitle(title)
    return figure, list(axes)


def plot_series(
    axes: Axes, x: Sequence[float], y: Sequence[float], label: str, color: str, **style: Any
) -> None:
    """The raw series, faint, under its rolling mean."""
    axes.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
    axes.plot(x, rolling(y), color=color, linewidth=1.8, label=label, **style)


def plot_present(
    axes: Axes,
    x: Sequence[float],
    y: Sequence[float | None],
    label: str,
    color: str,
    **style: Any,
) -> bool:
    """`plot_series` of the points whose value is known; False when none is."""
    points = [(xi, yi) for xi, yi in zip(x, y, strict=True) if yi is not None]
    if points:
        plot_series(axes, [p[0] for p in points], [p[1] for p in points], label, color, **style)
    return bool(points)


def by_trainer_step(*axes: Axes) -> None:
    """Trainer steps along the x axis, a light grid."""
    for each in axes:
        each.set_xlabel("trainer step")
        each.grid(alpha=0.3)


def steps_of(records: Sequence[StepRecord]) -> list[float]:
    return [float(r.step) for r in records]


def reward_plot(figures: RunFigures) -> Figure:
    """Reward and success versus step and versus minutes of training; eval decisions."""
    steps = figures.steps
    figure, (by_step, by_time) = new_figure("Reward and task success", 2)
    start = steps[0].time if steps else 0.0
    minutes = [(r.time - start) / 60 for r in steps]
    for axes, x in ((by_step, steps_of(steps)), (by_time, minutes)):
        plot_series(axes, x, [r.mean_reward for r in steps], f"reward ({SMOOTH}-step mean)", "C0")
        success = [r.success for r in steps]
        plot_present(axes, x, success, f"success ({SMOOTH}-step mean)", "C2", linestyle="--")
        axes.set_ylabel("mean over the step's samples")
        axes.grid(alpha=0.3)
    for decision in figures.evals:
        color = "C2" if decision.promoted else "C3"
        by_step.scatter([decision.step], [decision.candidate_score], color=color, marker="D", s=25)
    if figures.evals:
        by_step.scatter([], [], color="C2", marker="D", label="eval: promoted")
        by_step.scatter([], [], color="C3", marker="D", label="eval: rejected")
    by_step.set_xlabel("trainer step")
    by_time.set_xlabel("minutes since the first step")
    by_step.legend(loc="lower right", fontsize=8)
    return figure


def staleness_plot(figures: RunFigures) -> Figure:
    """Versions between a sample's policy and the trainer's; samples dropped as stale."""
    steps = figures.steps
    figure, (versions, dropped) = new_figure("Staleness", 2)
    x = steps_of(steps)
    plot_series(versions, x, [mean_staleness(r) for r in steps], "mean", "C0")
    maxima = [max((int(k) for k in r.staleness), default=0) for r in steps]
    versions.plot(x, maxima, ".", color="C1", markersize=3, alpha=0.6, label="max")
    versions.set_ylabel("versions behind the trainer")
    fractions = [r.num_dropped / max(r.num_samples + r.num_dropped, 1) for r in steps]
    plot_series(dropped, x, fractions, "dropped as too stale", "C3")
    dropped.set_ylabel("fraction of the step's samples")
    by_trainer_step(versions, dropped)
    for axes in (versions, dropped):
        axes.legend(fontsize=8)
    return figure


def throughput_plot(figures: RunFigures) -> Figure:
    """Samples and tokens per second; how the trainer's time was spent."""
    steps = figures.steps
    figure, (rates, busy) = new_figure("Throughput", 2)
    x = steps_of(steps)
    plot_series(rates, x, [r.samples_per_s for r in steps], "samples/s (step + wait)", "C0")
    rates.set_ylabel("samples / s")
    tokens = rates.twinx()
    plot_series(tokens, x, [r.tokens_per_s for r in steps], "trained tokens/s (step)", "C1")
    tokens.set_ylabel("tokens / s")
    rates.legend(loc="upper left", fontsize=8)
    tokens.legend(loc="upper right", fontsize=8)
    busy.plot(x, [r.busy_fraction for r in steps], color="C2", label="trainer busy (cumulative)")
    shares = [r.wait_s / max(r.wait_s + r.step_s, 1e-9) for r in steps]
    plot_series(busy, x, shares, "waiting for samples (share of step)", "C3")
    busy.set_ylim(0, 1.05)
    busy.set_ylabel("fraction of time")
    busy.legend(fontsize=8)
    by_trainer_step(rates, busy)
    return figure


def episodes_plot(figures: RunFigures) -> Figure:
    """Tool-call validity; turns and context segments per trained episode."""
    steps = [r for r in figures.steps if r.turns_per_episode is not None]
    figure, (validity, length) = new_figure("Episodes: tool use and length", 2)
    x = steps_of(steps)
    validities = [r.tool_call_validity for r in steps]
    if plot_present(validity, x, validities, "well-formed tool calls / calls", "C0"):
        validity.legend(fontsize=8)
    validity.set_ylim(0, 1.05)
    validity.set_ylabel("fraction of calls")
    plot_series(length, x, [r.turns_per_episode or 0.0 for r in steps], "turns", "C1")
    segments = [r.segments_per_episode or 0.0 for r in steps]
    plot_series(length, x, segments, "context segments", "C2")
    length.set_ylabel("per episode")
    length.legend(fontsize=8)
    by_trainer_step(validity, length)
    return figure


def mismatch_plot(figures: RunFigures) -> Figure:
    """Train/inference mismatch at the same version, and the importance weights."""
    measured = figures.mismatch_steps
    figure, (mismatch, weights) = new_figure("Train / inference mismatch; importance weights", 2)
    x = steps_of(measured)
    plot_series(mismatch, x, [r.mismatch_mean_abs for r in measured], "mean |Δ logprob|", "C0")
    mismatch.set_ylabel("mean |Δ logprob|, nats per token")
    kl = mismatch.twinx()  # the KL is orders of magnitude below the mean difference
    plot_series(kl, x, [r.mismatch_kl for r in measured], "KL (k3), right axis", "C1")
    kl.set_ylabel("KL(inference || trainer), nats per token")
    kl.legend(loc="upper right", fontsize=8)
    if not measured:
        mismatch.text(0.5, 0.5, "no same-version tokens", ha="center", transform=mismatch.transAxes)
    steps = figures.steps
    all_x = steps_of(steps)
    plot_series(weights, all_x, [r.is_weight_mean for r in steps], "importance weight mean", "C0")
    weights.plot(all_x, [r.is_weight_max for r in steps], color="C1", linewidth=0.8, label="max")
    plot_series(weights, all_x, [r.is_truncated_fraction for r in steps], "truncated share", "C3")
    mismatch.legend(loc="upper left", fontsize=8)
    weights.legend(fontsize=8)
    mismatch.set_xlabel("trainer step (steps with same-version tokens)")
    weights.set_xlabel("trainer step")
    for axes in (mismatch, weights):
        axes.grid(alpha=0.3)
    return figure


def training_plot(figures: RunFigures) -> Figure:
    """Loss, gradient norm and learning rate."""
    steps = figures.steps
    figure, (loss, grad, rate) = new_figure("Optimizer", 3)
    x = steps_of(steps)
    plot_series(loss, x, [r.loss for r in steps], "loss", "C0")
    plot_series(grad, x, [r.grad_norm for r in steps], "gradient norm", "C1")
    rate.plot(x, [r.learning_rate for r in steps], color="C2", label="learning rate")
    by_trainer_step(loss, grad, rate)
    for axes in (loss, grad, rate):
        axes.legend(fontsize=8)
    return figure
