"""oneDNN's CPU kernels on unless the user chose (runtime/onednn.py): importing
epl_trainer before TensorFlow sets TF_ENABLE_ONEDNN_OPTS=1 when it is unset, a user's
value is kept, and epl.init() says which, or what to do when TensorFlow came first."""

import json
import subprocess
import sys

import pytest
from _launch import clean_env

_SCRIPT = """
import json, logging, os, sys
logging.basicConfig(format="%(message)s")  # the notice is an INFO record (advice a WARNING)
logging.getLogger("epl_trainer").setLevel(logging.INFO)
{before}
import epl_trainer as epl
import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port
{after}
epl.init(epl.Config({{"cluster.virtual_devices": 1}}))
epl.init(epl.Config({{"cluster.virtual_devices": 1}}))  # says it once per process
print(json.dumps({{"env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                  "enabled": bool(_pywrap_util_port.IsMklEnabled())}}))
"""


def _run(env_value, before="", after=""):
    env = clean_env()
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    if env_value is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = env_value
    script = _SCRIPT.format(before=before, after=after)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    notices = [line for line in result.stderr.splitlines() if line.startswith("epl_trainer: ")]
    return json.loads(result.stdout.strip().splitlines()[-1]), notices


@pytest.mark.onednn
def test_unset_becomes_on_and_init_says_so_once():
    state, notices = _run(None)
    assert state == {"env": "1", "enabled": True}
    assert len(notices) == 1 and "TF_ENABLE_ONEDNN_OPTS was unset, so it is 1" in notices[0]


@pytest.mark.onednn
@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True)])
def test_a_users_choice_is_kept_silently(value, enabled):
    state, notices = _run(value)
    assert state == {"env": value, "enabled": enabled}
    assert notices == []


@pytest.mark.onednn
def test_tensorflow_imported_first_without_onednn_gets_advice():
    """TensorFlow loaded before epl_trainer, off (here forced with 0, then the variable
    removed, as on a CPU whose default is off): the setting cannot change any more, so
    init says how to get it."""
    before = "os.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'\nimport tensorflow"
    after = "del os.environ['TF_ENABLE_ONEDNN_OPTS']"
    state, notices = _run(None, before=before, after=after)
    assert state == {"env": None, "enabled": False}
    assert len(notices) == 1 and "imported before epl_trainer" in notices[0]
    assert "set TF_ENABLE_ONEDNN_OPTS=1" in notices[0]


# TensorFlow's first import is stopped where it starts, with TF_ENABLE_ONEDNN_OPTS as
# TensorFlow would have read it: a fresh process per job that never loads TensorFlow
# (0.1 s each, measured; importing the whole job took 3.2-3.4 s).
_ZOO_SCRIPT = """
import importlib.abc, os, sys

class StopAtTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            print("TF_ENABLE_ONEDNN_OPTS at TensorFlow's import:",
                  os.environ.get("TF_ENABLE_ONEDNN_OPTS"), flush=True)
            os._exit(0)
        return None

sys.meta_path.insert(0, StopAtTensorFlow())
import model_zoo.{job}.__main__
print("TensorFlow was not imported")
"""


@pytest.mark.parametrize(
    "job", ["bert_squad", "moe_t5", "quickstart", "resnet50", "text_classifier"]
)
def test_the_zoo_jobs_import_epl_trainer_before_tensorflow(job):
    """A job that imports Keras first loads TensorFlow before epl_trainer can choose: on a
    CPU where TensorFlow's default is off (AVX2-only), the main job ran without oneDNN's
    kernels and printed advice to the user instead. The job's import must reach
    TensorFlow's with TF_ENABLE_ONEDNN_OPTS=1 set (epl_trainer imported first)."""
    env = clean_env()
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    result = subprocess.run(
        [sys.executable, "-c", _ZOO_SCRIPT.format(job=job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        result.stdout.strip().splitlines()[-1] == "TF_ENABLE_ONEDNN_OPTS at TensorFlow's import: 1"
    )
