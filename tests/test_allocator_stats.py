"""Peak-memory statistics on every CPU (epl_trainer.training.memory.allocator_memory).

TensorFlow's default CPU allocator keeps no statistics; it uses its BFC allocator, which
does, only where oneDNN is on (by default only on some CPUs). `configure_tensorflow`
asks for the BFC allocator before TensorFlow starts, so peak memory is measurable with
oneDNN on or off. Each case is a fresh process: the allocator is chosen at start-up.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)

_MEASURE = """
import json
from epl_trainer.runtime.cluster import configure_tensorflow
configure_tensorflow(2)
import tensorflow as tf
from epl_trainer.training.memory import (
    AllocatorStatsUnavailable, allocator_memory, reset_peak_memory,
)
try:
    reset_peak_memory()
    before = allocator_memory()
    with tf.device("/CPU:1"):  # a logical device: the same process-wide allocator
        x = tf.ones([1024, 1024])  # 4 MiB
        y = (x * 2.0).numpy()
    del x
    after = allocator_memory()
    print(json.dumps({"before": before, "after": after}))
except AllocatorStatsUnavailable as e:
    print(json.dumps({"error": str(e)}))
"""


def _run(environment: dict) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **environment}
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    env.update(environment)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.onednn
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_peak_memory_is_measured_with_onednn_on_and_off(onednn):
    result = _run({"TF_ENABLE_ONEDNN_OPTS": onednn})
    assert "error" not in result, result
    grown = result["after"]["peak"] - result["before"]["peak"]
    assert grown >= 4 * 2**20, result  # the 4 MiB tensor (and its product) were seen


def test_an_allocator_without_statistics_is_a_clear_error():
    result = _run({"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "false"})
    assert "keeps no memory statistics" in result["error"]
    assert "TF_CPU_ALLOCATOR_USE_BFC='false'" in result["error"]
