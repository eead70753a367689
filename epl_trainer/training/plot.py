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
    PlacedSchedule,
    Schedule,
    gpipe_schedule,
    interleaved_schedule,
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

    One row per stage (stage 0 on top; per device for an interleaved schedule, whose later
    chunks' boxes are lighter), one box per forward / backward (/ weight gradient
    of a zero-bubble schedule) at its unit time
    step from `core.schedule.timeline`, labelled with its micro-batch ("F3", "B3").

    Args:
      plan_or_schedule: a `Plan` (its TaskGraphs are the stages; the schedule is built
        from `num_micro_batch` and the plan's `pipeline_strategy`, "PreferBackward"
        if it has none), or a `Schedule` tuple as `core.schedule` builds it.
      path: where to write; the suffix picks the format: ".png" or ".svg".
      title: replaces the default title (strategy, stages, micro-batches, bubble).
      strategy: "PreferForward", "PreferBackward", "ZeroBubbleH1" or "Interleaved1F1B" (with
        the plan's `virtual_stages`). With a Plan it overrides the
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
    rows = len(row_labels)  # stages, or the devices of an interleaved schedule
    # Measured from the simulation rather than GPipe's formula, so a hand-made schedule
    # shows its own idle time; for both built-in strategies the two agree.
    bubble = 1 - len(entries) / (rows * makespan)

    label_width = max(len(label) for label in row_labels) * 0.075 + 0.4
    natural = _MARGIN_INCHES + label_width + _INCHES_PER_STEP * makespan
    width = min(_MAX_WIDTH_INCHES, max(_MIN_WIDTH_INCHES, natural))
    height = 1.5 + _INCHES_PER_STAGE * rows
    figure = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    step_inches = (width - _MARGIN_INCHES - label_width) / makespan
    _draw_tasks(axes, entries, step_inches, getattr(schedule, "stage_device", None))

    axes.set_xlim(0, makespan)
    axes.set_ylim(rows - 0.5, -0.5)  # stage 0 on top
    axes.set_yticks(range(rows), row_labels)
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
    if title is None and rows != num_stages:
        title = (
            f"{_strategy_label(strategy)} (v={num_stages // rows}): "
            f"{_plural(num_stages, 'stage')} on {_plural(rows, 'device')} x "
            f"{_plural(num_micro_batch, 'micro-batch')}, {makespan} steps, bubble {bubble:.1%}"
        )
    if title is None:
        title = (
            f"{_strategy_label(strategy)}: {_plural(num_stages, 'stage')} x "
            f"{_plural(num_micro_batch, 'micro-batch')}, {makespan} steps, bubble {bubble:.1%}"
        )
    axes.set_title(title, fontsize=10)
    return figure


def _draw_tasks(axes, entries, step_inches: float, stage_device=None) -> None:
    """One box per (stage, step, task), labelled when a step is wide enough to read; on
    its device's row, lighter for later chunks, with `stage_device` (interleaved)."""
    from matplotlib.patches import Rectangle

    font_size = 8 if step_inches >= _INCHES_PER_STEP else 6
    devices = 1 + max(stage_device) if stage_device else 0
    for stage, step, task in entries:
        row = stage if stage_device is None else stage_device[stage]
        chunk = stage // devices if devices else 0
        axes.add_patch(
            Rectangle(
                (step, row - 0.4),
                1,
                0.8,
                facecolor=_COLORS[task.kind],
                alpha=1.0 if chunk % 2 == 0 else 0.55,
                edgecolor="white",
                linewidth=1.0,
                gid=f"task:{stage}:{task}",
            )
        )
        if step_inches >= _MIN_LABELLED_STEP_INCHES:
            axes.text(
                step + 0.5,
                row,
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
        virtual_stages = getattr(plan, "virtual_stages", 1)
        schedule = make_schedule(
            strategy, len(plan.taskgraphs), plan.num_micro_batch, virtual_stages
        )
        if isinstance(schedule, PlacedSchedule):  # one row per device
            devices = [plan.placement[0][d][0].short_name for d in range(plan.pipeline_devices)]
            return schedule, strategy, [f"device {d} ({name})" for d, name in enumerate(devices)]
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
    if isinstance(plan_or_schedule, PlacedSchedule):
        schedule = plan_or_schedule
        devices = len(schedule.device_orders)
        if strategy is None and devices and len(schedule) % devices == 0:
            forwards = sum(task.kind == FORWARD for task in schedule[0])
            built = interleaved_schedule(len(schedule), forwards, len(schedule) // devices)
            strategy = "Interleaved1F1B" if built.device_orders == schedule.device_orders else None
        return schedule, strategy, [f"device {d}" for d in range(devices)]
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
        "Interleaved1F1B": "Interleaved1F1B",
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
