"""Shared test setup: 8 logical CPU devices, configured before TensorFlow initialises.

Every test process gets the same devices; a trainer uses the first
`cluster.virtual_devices` of them.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from epl_trainer.cluster import configure_tensorflow

NUM_TEST_DEVICES = 8
configure_tensorflow(NUM_TEST_DEVICES)


import pytest  # noqa: E402

from epl_trainer.annotations.strategies import reset_annotations  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_annotations():
    """EPL semantics: after a `replicate` scope closes, new layers still join its TaskGraph.
    So one test's scopes would annotate the next test's models; each test starts clean."""
    reset_annotations()
    yield
    reset_annotations()
