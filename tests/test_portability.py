"""The library on an OS without Linux's process interfaces (macOS, Windows): imported, a
one-device fit, and the process statistics, with `os.sched_getaffinity` gone and every
read of /proc from epl_trainer's own code failing (psutil keeps its per-OS access, as it
has on those systems)."""

import json
import subprocess
import sys

from _launch import clean_env

_SCRIPT = r"""
import builtins, json, os, sys

def _from_our_code() -> bool:
    frame, ours = sys._getframe(2), False
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("psutil"):
            return False  # psutil's own access to the OS, as on any OS
        ours = ours or module.startswith("epl_trainer")
        frame = frame.f_back
    return ours

blocked = []

def _guard(function):
    def guarded(path, *args, **kwargs):
        if str(path).startswith("/proc") and _from_our_code():
            blocked.append(str(path))
            raise FileNotFoundError(f"no /proc on this OS (simulated): {path}")
        return function(path, *args, **kwargs)
    return guarded

builtins.open = _guard(builtins.open)
os.listdir = _guard(os.listdir)
os.scandir = _guard(os.scandir)
del os.sched_getaffinity

import epl_trainer as epl
from epl_trainer.runtime.cluster import available_cores

epl.init(epl.Config({"cluster.virtual_devices": 1}))
import keras
import numpy as np

from epl_trainer.training import memory

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
x, y = np.random.rand(32, 4).astype("float32"), np.random.rand(32, 1).astype("float32")
history = epl.EPLTrainer(model).fit(x, y, batch_size=8, epochs=2, verbose=0)
print(json.dumps({
    "losses": history.history["loss"],
    "cores": available_cores(),
    "threads": memory.process_threads(),
    "rss_mib": memory.process_rss_mib(),
    "blocked": blocked,
}))
"""


def test_one_device_fit_without_sched_getaffinity_or_proc():
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["losses"]) == 2 and report["losses"][1] < report["losses"][0]
    assert report["cores"] >= 1  # os.cpu_count() stands in for the affinity
    assert report["threads"] > 1 and report["rss_mib"] > 0
    assert report["blocked"] == []  # nothing of ours reached for /proc
