"""Shared test setup: 8 logical CPU devices, configured before TensorFlow initialises.

Every test process gets the same devices; a trainer uses the first
`cluster.virtual_devices` of them.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from epl_trainer.runtime.cluster import configure_tensorflow

NUM_TEST_DEVICES = 8
configure_tensorflow(NUM_TEST_DEVICES)


import pytest  # noqa: E402

from epl_trainer.annotations.strategies import reset_annotations  # noqa: E402
from epl_trainer.runtime.env import Env  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `sweep` (hundreds of repetitions of what a default test shows a few
    times, e.g. 200 kill points) run only with EPL_SWEEPS=1: CI's run stays within its time."""
    if os.environ.get("EPL_SWEEPS") == "1":
        return
    skip = pytest.mark.skip(reason="a long sweep: run it with EPL_SWEEPS=1")
    for item in items:
        if "sweep" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """EPL semantics: after a `replicate` scope closes, new layers still join its TaskGraph,
    and `epl.init`'s config holds for the rest of the process. So one test's scopes would
    annotate the next test's models, and its `epl.init` would be the next test's base
    config (a DeepSpeed recipe translated on top of 2 devices instead of one ran one step,
    not two, in whichever test came after it); each test starts clean."""
    reset_annotations()
    env = Env._instance
    yield
    reset_annotations()
    Env._instance = env
