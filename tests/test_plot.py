"""plot_schedule: Gantt charts of pipeline schedules. No TensorFlow needed."""

import sys
import types

import matplotlib.colors
import matplotlib.image
import pytest

from epl_trainer.core.plan.ir import StrategySpec
from epl_trainer.core.plan.planner import build_plan
from epl_trainer.core.plan.schedule import (
    ScheduleError,
    Task,
    gpipe_schedule,
    one_f_one_b_schedule,
    timeline,
)
from epl_trainer.training.plot import _COLORS, _schedule_figure, plot_schedule


def pipeline_plan(num_stages: int, num_micro_batch: int):
    """S one-device stages on 2*S devices: two pipelines; the chart shows replica 0."""
    devices = [[f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2 * num_stages)]]
    stages = [StrategySpec("replicate", 1, f"stage_{i}") for i in range(num_stages)]
    plan = build_plan(stages, devices, 0, num_micro_batch=num_micro_batch)
    assert plan.num_replicas == 2
    return plan


def task_boxes(figure):
    (axes,) = figure.axes
    return [patch for patch in axes.patches if (patch.get_gid() or "").startswith("task:")]


def box_positions(figure) -> dict[tuple[int, str], int]:
    """{(stage, "F3"): time step} read back from the drawn rectangles."""
    positions = {}
    for box in task_boxes(figure):
        _, stage, task = box.get_gid().split(":")
        positions[(int(stage), task)] = round(box.get_x())
        assert round(box.get_y() + box.get_height() / 2) == int(stage)
    return positions


# ------------------------------------------------------------------- writing
@pytest.mark.parametrize(("num_stages", "num_micro_batch"), [(2, 4), (4, 8)])
def test_png_is_written_and_readable(tmp_path, num_stages, num_micro_batch):
    plan = pipeline_plan(num_stages, num_micro_batch)
    path = tmp_path / "schedule.png"
    assert plot_schedule(plan, path) == path
    assert path.stat().st_size > 5_000
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    figure = _schedule_figure(plan)
    fig_width, fig_height = figure.get_size_inches()
    assert width / height == pytest.approx(fig_width / fig_height, rel=0.02)
    assert width > 2 * height  # time runs along a wide x axis
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_svg_by_suffix_and_str_path(tmp_path):
    path = tmp_path / "schedule.SVG"
    assert plot_schedule(pipeline_plan(2, 2), str(path)) == path
    text = path.read_text()
    assert "<svg" in text
    assert text.count('id="task:') == 2 * 2 * 2


def test_unsupported_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.png or \.svg.*Received: path='.*schedule\.pdf'"):
        plot_schedule(pipeline_plan(2, 2), tmp_path / "schedule.pdf")
    assert not (tmp_path / "schedule.pdf").exists()


# -------------------------------------------------------------- figure content
@pytest.mark.parametrize(
    ("num_stages", "num_micro_batch"), [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (4, 2), (4, 8)]
)
@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_one_box_per_task(num_stages, num_micro_batch, strategy):
    figure = _schedule_figure(pipeline_plan(num_stages, num_micro_batch), strategy=strategy)
    boxes = task_boxes(figure)
    assert len(boxes) == 2 * num_stages * num_micro_batch
    colors = [matplotlib.colors.to_hex(box.get_facecolor()) for box in boxes]
    assert colors.count(_COLORS["F"].lower()) == num_stages * num_micro_batch
    assert colors.count(_COLORS["B"].lower()) == num_stages * num_micro_batch


def test_boxes_follow_the_timeline_and_are_labelled():
    figure = _schedule_figure(pipeline_plan(4, 8))
    expected = {(s, str(t)): step for s, step, t in timeline(one_f_one_b_schedule(4, 8))}
    assert box_positions(figure) == expected
    labels = sorted(text.get_text() for text in figure.axes[0].texts)
    assert labels == sorted(str(task) for _, task in expected)


def test_rows_are_named_after_taskgraphs_and_devices():
    figure = _schedule_figure(pipeline_plan(4, 8))
    (axes,) = figure.axes
    assert [label.get_text() for label in axes.get_yticklabels()] == [
        f"stage_{i} (w0:CPU:{i})" for i in range(4)
    ]
    bottom, top = axes.get_ylim()
    assert top < bottom  # stage 0 on top


def test_title_and_legend():
    figure = _schedule_figure(pipeline_plan(4, 8))
    title = figure.axes[0].get_title()
    assert title == "PreferBackward (1F1B): 4 stages x 8 micro-batches, 22 steps, bubble 27.3%"
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["forward", "backward"]
    custom = _schedule_figure(pipeline_plan(2, 2), title="my run")
    assert custom.axes[0].get_title() == "my run"


def test_strategy_override_and_plan_field():
    plan = pipeline_plan(2, 4)
    gpipe = {(s, str(t)): step for s, step, t in timeline(gpipe_schedule(2, 4))}
    figure = _schedule_figure(plan, strategy="PreferForward")
    assert box_positions(figure) == gpipe
    assert figure.axes[0].get_title().startswith("PreferForward (GPipe): 2 stages x 4")
    # Plans carrying a `pipeline_strategy` field are drawn with that strategy.
    tagged = types.SimpleNamespace(
        taskgraphs=plan.taskgraphs,
        num_micro_batch=plan.num_micro_batch,
        placement=plan.placement,
        pipeline_strategy="PreferForward",
    )
    assert box_positions(_schedule_figure(tagged)) == gpipe


def test_unknown_strategy():
    with pytest.raises(ScheduleError, match="Received: strategy='GPipe'"):
        _schedule_figure(pipeline_plan(2, 2), strategy="GPipe")


# -------------------------------------------------------------- raw schedules
def test_raw_schedule(tmp_path):
    schedule = one_f_one_b_schedule(3, 4)
    path = plot_schedule(schedule, tmp_path / "raw.png")
    assert matplotlib.image.imread(path).size > 0
    figure = _schedule_figure(schedule)
    assert len(task_boxes(figure)) == 24
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == [
        "stage_0",
        "stage_1",
        "stage_2",
    ]
    assert figure.axes[0].get_title().startswith("PreferBackward (1F1B): 3 stages x 4")
    gpipe_title = _schedule_figure(gpipe_schedule(3, 4)).axes[0].get_title()
    assert gpipe_title.startswith("PreferForward (GPipe)")


def test_custom_raw_schedule_shows_its_own_bubble():
    # Both stages keep one micro-batch in flight: valid, neither built-in, and slow.
    one_in_flight = (Task("F", 0), Task("B", 0), Task("F", 1), Task("B", 1))
    schedule = (one_in_flight, one_in_flight)
    title = _schedule_figure(schedule).axes[0].get_title()
    # t: s0 F0 0, s1 F0 1, s1 B0 2, s0 B0 3, s0 F1 4, s1 F1 5, s1 B1 6, s0 B1 7 -> 8 steps
    assert title == "Custom schedule: 2 stages x 2 micro-batches, 8 steps, bubble 50.0%"


def test_invalid_inputs():
    with pytest.raises(ScheduleError, match="deadlocks"):
        _schedule_figure(
            (
                (Task("F", 0), Task("B", 0), Task("F", 1), Task("B", 1)),
                (Task("F", 0), Task("F", 1), Task("B", 0), Task("B", 1)),
            )
        )
    with pytest.raises(TypeError, match=r"Plan or a Schedule.*Received: int"):
        _schedule_figure(3)


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_schedule(pipeline_plan(2, 2), tmp_path / "schedule.png")
