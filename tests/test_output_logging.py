"""The library's messages go through Python's `logging`, never stdout: `fit(verbose=0)`
prints nothing, the XLA choice ("auto"'s, once per process) is an INFO record of
`epl_trainer.core.engine.engine`, `epl.init()`'s oneDNN notice an INFO (its kernels run)
or WARNING (advice: they do not) record, and an absl program shows them on stderr with
absl's handler."""

import logging
import subprocess
import sys

import keras
from _launch import clean_env
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.core.engine import engine
from epl_trainer.runtime import env, onednn

JIT_LINE = "EPLTrainer jit_compile="


def _records(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


def test_fit_with_verbose_0_prints_nothing_and_logs_the_jit_choice(monkeypatch, capfd, caplog):
    monkeypatch.setattr(engine, "_ANNOUNCED", set())
    caplog.set_level(logging.INFO, logger="epl_trainer")
    x, y = mlp_data()
    config = {"cluster.virtual_devices": 2}
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.SGD(0.1), config=config)
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    out, err = capfd.readouterr()
    assert out == ""
    assert JIT_LINE not in err  # no handler of the user's shows INFO: nothing anywhere
    [record] = _records(caplog, JIT_LINE)
    assert record.levelno == logging.INFO
    assert record.name == "epl_trainer.core.engine.engine"
    assert record.getMessage().startswith(f"{JIT_LINE}auto: ")


def test_init_logs_the_onednn_choice_at_info(monkeypatch, capfd, caplog):
    """oneDNN's kernels run because the package set the variable: a notice."""
    monkeypatch.setattr(onednn, "_noticed", False)
    monkeypatch.setattr(onednn, "_set_by_us", True)
    monkeypatch.setattr(env, "onednn_enabled", lambda: True)
    caplog.set_level(logging.INFO, logger="epl_trainer")
    epl.init({"cluster.virtual_devices": 2})
    out, err = capfd.readouterr()
    assert "TF_ENABLE_ONEDNN_OPTS" not in out + err
    [record] = _records(caplog, "TF_ENABLE_ONEDNN_OPTS was unset, so it is 1")
    assert (record.levelno, record.name) == (logging.INFO, "epl_trainer.runtime.env")


def test_init_warns_when_tensorflow_runs_without_onednn(monkeypatch, caplog):
    """TensorFlow came first and without oneDNN: advice for several times faster steps,
    a WARNING (shown even where nobody configured logging: Python's last-resort handler)."""
    monkeypatch.setattr(onednn, "_noticed", False)
    monkeypatch.setattr(onednn, "_set_by_us", False)
    monkeypatch.delenv(onednn.ENV, raising=False)
    monkeypatch.setattr(env, "onednn_enabled", lambda: False)
    epl.init({"cluster.virtual_devices": 2})
    [record] = _records(caplog, "imported before epl_trainer")
    assert record.levelno == logging.WARNING


_ABSL_JOB = """
import epl_trainer as epl
import keras
import numpy as np
from absl import app

def main(argv):
    epl.init({"cluster.virtual_devices": 1})
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    trainer = epl.EPLTrainer(model, "mse", "sgd")
    x = np.ones((8, 4), "float32")
    trainer.fit(x, np.ones((8, 2), "float32"), batch_size=4, epochs=1, verbose=0)

app.run(main)
"""


def test_an_absl_program_shows_the_jit_choice_on_stderr():
    """As the zoo's jobs run: `absl.app.run` puts absl's handler on the root logger at
    INFO, so the choice is shown without any setup; stdout stays empty."""
    result = subprocess.run(
        [sys.executable, "-c", _ABSL_JOB],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == ""
    assert f"{JIT_LINE}auto: " in result.stderr
