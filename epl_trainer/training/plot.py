"""Draw a pipeline schedule as a Gantt chart: `epl_trainer.plot_schedule(plan, "s.png")`.

matplotlib is optional (the trainer never needs it), so it is imported only when a
chart is drawn. Figures are rendered with the non-interactive Agg canvas directly,
without pyplot, so plotting neither opens windows nor changes the process's global
matplotlib backend.
"""

from __future__ import annotations

import os
from pathlib import Path

from epl_trainer.core.plan.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Schedule,
    gpipe_schedule,
    make_schedule,
    one_f_one_b_schedule,
    splits_backward,
    timeline,
    zero_bubble_h1_schedule,
)

__all__ = ["plot_schedule"]

_COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", WEIGHT: "#55A868"}
_LEGEND = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}
_FORMATS = (".png", ".svg")
_INCHES_PER_STEP = 0.42  # fits a label like "B12" at the box font size
_INCHES_PER_STAGE = 0.55
_MARGIN_INCHES = 1.2  # axes padding outside the row labels
_MIN_WIDTH_INCHES = 6.4  # room for the title
_MAX_WIDTH_INCHES = 24.0  # past this, boxes shrink and lose their labels
_MIN_LABELLED_STEP_INCHES = 0.25
_DPI = 110


def plot_schedule(
    plan_or_schedule,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    strategy: str | None = None,
) -> Path:
    """Writes the pipeline schedule of a Plan (or a raw Schedule) as a Gantt chart.

    One row per stage (stage 0 on top), one box per forward / backward (/ weight gradient
    of a zero-bubble schedule) at its unit time
    step from `core.schedule.timeline`, labelled with its micro-batch ("F3", "B3").

    Args:
      plan_or_schedule: a `Plan` (its TaskGraphs are the stages; the schedule is built
        from `num_micro_batch` and the plan's `pipeline_strategy`, "PreferBackward"
        if it has none), or a `Schedule` tuple as `core.schedule` builds it.
      path: where to write; the suffix picks the format: ".png" or ".svg".
      title: replaces the default title (strategy, stages, micro-batches, bubble).
      strategy: "PreferForward", "PreferBackward" or "ZeroBubbleH1". With a Plan it overrides the
        plan's strategy; with a raw Schedule it only names the schedule in the title.

    Returns:
      `path` as a `Path`.

    Raises:
      ImportError: matplotlib is not installed.
      ValueError: unsupported suffix, unknown strategy or invalid schedule.
    """
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(
            f"plot_schedule writes {' or '.join(_FORMATS)} files, chosen by suffix. "
            f"Received: path={str(path)!r}"
        )
    figure = _schedule_figure(plan_or_schedule, title=title, strategy=strategy)
    figure.savefig(path, format=path.suffix.lower()[1:], dpi=_DPI)
    return path


def _schedule_figure(plan_or_schedule, *, title=None, strategy=None):
    """The chart as a matplotlib `Figure` (separate from saving so tests can inspect it)."""
    _import_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule, strategy, row_labels = _resolve(plan_or_schedule, strategy)
    entries = timeline(schedule)  # validates; raises ScheduleError (a ValueError)
    num_stages = len(schedule)
    num_micro_batch = sum(task.kind == FORWARD for task in schedule[0])
    makespan = 1 + max(step for _, step, _ in entries)
    # Measured from the simulation rather than GPipe's formula, so a hand-made schedule
    # shows its own idle time; for both built-in strategies the two agree.
    bubble = 1 - len(entries) / (num_stages * makespan)

    label_width = max(len(label) for label in row_labels) * 0.075 + 0.4
    natural = _MARGIN_INCHES + label_width + _INCHES_PER_STEP * makespan
    width = min(_MAX_WIDTH_INCHES, max(_MIN_WIDTH_INCHES, natural))
    height = 1.5 + _INCHES_PER_STAGE * num_stages
    figure = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    step_inches = (width - _MARGIN_INCHES - label_width) / makespan
    _draw_tasks(axes, entries, step_inches)

    axes.set_xlim(0, makespan)
    axes.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top
    axes.set_yticks(range(num_stages), row_labels)
    tick_every = 1 if makespan <= 40 else 5
    axes.set_xticks(range(0, makespan + 1, tick_every))
    axes.tick_params(axis="x", labelsize=7)
    axes.set_xlabel("time step (every task takes one unit)")
    axes.grid(axis="x", color="0.88", linewidth=0.6)
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    figure.legend(
        handles=[
            Patch(facecolor=_COLORS[kind], label=_LEGEND[kind])
            for kind in _COLORS
            if kind != WEIGHT or splits_backward(schedule)
        ],
        loc="outside lower center",
        ncol=2,
        frameon=False,
        fontsize=8,
    )
    if title is None:
        title = (
            f"{_strategy_label(strategy)}: {_plural(num_stages, 'stage')} x "
            f"{_plural(num_micro_batch, 'micro-batch')}, {makespan} steps, bubble {bubble:.1%}"
        )
    axes.set_title(title, fontsize=10)
    return figure


def _draw_tasks(axes, entries, step_inches: float) -> None:
    """One box per (stage, step, task), labelled when a step is wide enough to read."""
    from matplotlib.patches import Rectangle

    font_size = 8 if step_inches >= _INCHES_PER_STEP else 6
    for stage, step, task in entries:
        axes.add_patch(
            Rectangle(
                (step, stage - 0.4),
                1,
                0.8,
                facecolor=_COLORS[task.kind],
                edgecolor="white",
                linewidth=1.0,
                gid=f"task:{stage}:{task}",
            )
        )
        if step_inches >= _MIN_LABELLED_STEP_INCHES:
            axes.text(
                step + 0.5,
                stage,
                str(task),
                ha="center",
                va="center",
                color="white",
                fontsize=font_size,
                fontweight="bold",
            )


def _resolve(plan_or_schedule, strategy) -> tuple[Schedule, str | None, list[str]]:
    """(schedule, strategy name or None, one label per stage)."""
    if hasattr(plan_or_schedule, "taskgraphs"):
        plan = plan_or_schedule
        if strategy is None:
            strategy = getattr(plan, "pipeline_strategy", "PreferBackward")
        schedule = make_schedule(strategy, len(plan.taskgraphs), plan.num_micro_batch)
        labels = []
        for index, taskgraph in enumerate(plan.taskgraphs):
            devices = plan.placement[0][index]
            more = f" +{len(devices) - 1}" if len(devices) > 1 else ""
            labels.append(f"{taskgraph.name} ({devices[0].short_name}{more})")
        return schedule, strategy, labels
    if not isinstance(plan_or_schedule, tuple | list):
        raise TypeError(
            "plot_schedule takes a Plan or a Schedule (tuple of per-stage Task tuples). "
            f"Received: {type(plan_or_schedule).__name__}"
        )
    schedule = tuple(tuple(tasks) for tasks in plan_or_schedule)
    if strategy is None and schedule and schedule[0]:
        strategy = _recognise(schedule)
    return schedule, strategy, [f"stage_{s}" for s in range(len(schedule))]


def _recognise(schedule: Schedule) -> str | None:
    """The built-in strategy that produces `schedule`, if any."""
    num_stages = len(schedule)
    num_micro_batch = sum(task.kind == FORWARD for task in schedule[0])
    if num_micro_batch < 1:
        return None
    if splits_backward(schedule):
        zero_bubble = zero_bubble_h1_schedule(num_stages, num_micro_batch)
        return "ZeroBubbleH1" if schedule == zero_bubble else None
    if schedule == one_f_one_b_schedule(num_stages, num_micro_batch):
        return "PreferBackward"  # checked first: the two coincide for M == 1
    if schedule == gpipe_schedule(num_stages, num_micro_batch):
        return "PreferForward"
    return None


def _strategy_label(strategy: str | None) -> str:
    return {
        "PreferBackward": "PreferBackward (1F1B)",
        "PreferForward": "PreferForward (GPipe)",
        "ZeroBubbleH1": "ZeroBubbleH1 (ZB-H1)",
        None: "Custom schedule",
    }.get(strategy, str(strategy))


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("h") else "s")


def _import_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "epl_trainer.plot_schedule draws with matplotlib, which is not installed. "
            "Install it with `pip install matplotlib`."
        ) from error
