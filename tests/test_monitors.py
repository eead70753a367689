"""DeepSpeed monitors: CSV and TensorBoard files with DeepSpeed's names, headers and rows."""

import csv
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.deepspeed import DeepSpeedConfig
from epl_trainer.training import deepspeed_run, monitors, schedules

TWO_DEVICES = epl.Config({"cluster.virtual_devices": 2})
TAGS = [monitors.TRAIN_LOSS, monitors.LEARNING_RATE, monitors.LOSS_SCALE]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _tensorboard_scalars(directory):
    """{tag: [(step, value), ...]} from every event file in `directory`."""
    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars


def test_csv_writer_uses_deepspeed_file_names_and_headers(tmp_path):
    writer = monitors.CsvWriter(str(tmp_path / "out"), "job")
    writer.write_events([("Train/Samples/train_loss", 1.5, 0), ("Train/Samples/lr", 0.1, 32)])
    writer.write_events([("Train/Samples/train_loss", 1.25, 32), ("My tag", 3, 7)])
    directory = tmp_path / "out" / "job"
    assert sorted(p.name for p in directory.iterdir()) == [
        "My_tag.csv",
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    assert _rows(directory / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"],
        ["0", "1.5"],
        ["32", "1.25"],
    ]
    assert _rows(directory / "My_tag.csv") == [["step", "My tag"], ["7", "3"]]
    # A new run appends, with its own header line, as DeepSpeed's csv_monitor does.
    monitors.CsvWriter(str(tmp_path / "out"), "job").write_events([("Train/Samples/lr", 0.2, 64)])
    assert _rows(directory / "Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["32", "0.1"],
        ["step", "lr"],
        ["64", "0.2"],
    ]


def test_tensorboard_writer_writes_scalars_under_the_job_directory(tmp_path):
    writer = monitors.TensorBoardWriter(str(tmp_path), "tb_job")
    writer.write_events([("Train/Samples/lr", 0.5, 16), ("Train/Samples/lr", 0.25, 32)])
    writer.close()
    assert _tensorboard_scalars(tmp_path / "tb_job") == {
        "Train/Samples/lr": [(16, 0.5), (32, 0.25)]
    }


def _ds_values(tmp_path):
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "fp16": {"enabled": True, "initial_scale_power": 4},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
        "steps_per_print": 2,
    }


class _RunningLoss(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(logs["loss"])


def test_trainer_writes_deepspeed_events_per_step(tmp_path, caplog):
    x, y = mlp_data(n=160)
    trainer = epl.EPLTrainer(
        mlp(), LOSS, config=DeepSpeedConfig(_ds_values(tmp_path), base=TWO_DEVICES)
    )
    running = _RunningLoss()
    with caplog.at_level(logging.INFO, logger="epl_trainer.training.monitors"):
        trainer.fit(
            x, y, epochs=1, steps_per_epoch=5, callbacks=[running], verbose=0, shuffle=False
        )

    directory = tmp_path / "csv"
    assert sorted(p.name for p in directory.iterdir()) == [
        "Train_Samples_loss_scale.csv",
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    loss_rows = _rows(directory / "Train_Samples_train_loss.csv")
    lr_rows = _rows(directory / "Train_Samples_lr.csv")
    scale_rows = _rows(directory / "Train_Samples_loss_scale.csv")
    assert (loss_rows[0], lr_rows[0], scale_rows[0]) == (
        ["step", "train_loss"],
        ["step", "lr"],
        ["step", "loss_scale"],
    )
    # Loss at the samples seen before the step, lr and loss scale after it (DeepSpeed's x).
    assert [int(r[0]) for r in loss_rows[1:]] == [0, 32, 64, 96, 128]
    assert [int(r[0]) for r in lr_rows[1:]] == [32, 64, 96, 128, 160]
    assert [float(r[1]) for r in scale_rows[1:]] == [16.0] * 5  # 2**4, no overflow
    # Step k's learning rate is the schedule at k: 0, 0.0125, 0.025, 0.0375, 0.05.
    schedule = schedules.WarmupLR(0.0, 0.05, 4, "linear")
    expected_lr = [float(schedule(k)) for k in range(5)]
    assert [float(r[1]) for r in lr_rows[1:]] == pytest.approx(expected_lr)
    # Each row is that step's own loss: their running means are Keras's logged `loss`.
    step_losses = np.array([float(r[1]) for r in loss_rows[1:]])
    running_means = np.cumsum(step_losses) / np.arange(1, 6)
    np.testing.assert_allclose(running_means, running.values, rtol=1e-5)

    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert sorted(scalars) == sorted(TAGS)
    assert [s for s, _ in scalars[monitors.TRAIN_LOSS]] == [0, 32, 64, 96, 128]
    np.testing.assert_allclose([v for _, v in scalars[monitors.TRAIN_LOSS]], step_losses, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars[monitors.LEARNING_RATE]], expected_lr)

    # steps_per_print=2: DeepSpeed-style lines at steps 2 and 4.
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert [line.split(",")[0] for line in printed] == ["step=2", "step=4"]
    assert "skipped=0" in printed[0]

    # A second fit continues the x-axis and the same files (one header per run).
    trainer.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    loss_rows = _rows(directory / "Train_Samples_train_loss.csv")
    assert [r[0] for r in loss_rows] == ["step", "0", "32", "64", "96", "128", "160", "192"]


def test_monitors_run_on_worker_zero_only(tmp_path):
    config = DeepSpeedConfig(_ds_values(tmp_path), base=TWO_DEVICES)
    run = deepspeed_run.translate(config, keras.optimizers.SGD())
    assert run.callbacks(loss_tracker=None, is_chief=False) == []
    assert not (tmp_path / "csv").exists()


def test_monitor_without_tracker_logs_keras_loss(tmp_path):
    writer = monitors.CsvWriter(str(tmp_path), "plain")
    monitor = monitors.DeepSpeedMonitor([writer], train_batch_size=16)
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    x, y = mlp_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    rows = _rows(tmp_path / "plain" / "Train_Samples_lr.csv")
    assert rows[1:] == [["16", "0.10000000149011612"], ["32", "0.10000000149011612"]] + [
        [str(16 * k), "0.10000000149011612"] for k in (3, 4)
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_monitor_from_worker_zero_and_match_one_process(tmp_path):
    """Real workers: batch arithmetic over workers, one CSV writer, weights as one process."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = os.path.join(root, "tests", "scripts")
    values = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "mw"},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(values))
    command = [
        sys.executable,
        "-m",
        "epl_trainer.runtime.launcher",
        "--num_workers",
        "2",
        "--gpu_per_worker",
        "1",
        "--log_dir",
        str(tmp_path / "logs"),
        os.path.join(scripts, "train_deepspeed.py"),
        str(path),
        str(tmp_path / "out"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPL_")}
    env["PYTHONPATH"] = os.pathsep.join([root, scripts, env.get("PYTHONPATH", "")])
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    # 2 workers x 1 device: 32 = 8 x 2 accumulation steps x 2 lanes.
    expected = "BatchSizes(train_batch_size=32, micro_batch_size=8, gradient_accumulation_steps=2"
    for worker in range(2):
        assert (tmp_path / "out" / f"batch_{worker}.txt").read_text().startswith(expected)
    rows = _rows(tmp_path / "mw" / "Train_Samples_train_loss.csv")
    assert [r[0] for r in rows] == ["step", "0", "32", "64"]  # one writer: no duplicates

    sys.path.insert(0, scripts)
    import train_dp

    reference = train_dp.make_model()
    trainer = epl.EPLTrainer(
        reference,
        LOSS,
        config=DeepSpeedConfig({k: values[k] for k in list(values)[:3]}, base=TWO_DEVICES),
    )
    x, y = train_dp.make_data()
    trainer.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    for worker in range(2):
        weights = np.load(tmp_path / "out" / f"weights_{worker}.npz")
        for i, value in enumerate(reference.get_weights()):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)
