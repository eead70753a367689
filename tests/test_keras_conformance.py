"""Keras conformance (issue #28, item 1): Keras's own tests, run with `keras.Model.fit` /
`evaluate` / `predict` routed through `EPLTrainer` on 2 logical CPU devices
(tests/keras_conformance/).

Files: every `keras/src/callbacks/*_test.py` that calls `fit`, and
`keras/src/models/{model,functional,sequential}_test.py` (`EPL_CONFORMANCE_GROUPS` picks
"callbacks" and/or "models"). Each layout is one test, a fresh pytest subprocess on copies
of the installed wheel's test files: "dp" (`cluster.virtual_devices: 2`, data parallel)
and "pipeline" (auto.auto_parallel, 2 stages, 2 micro-batches); `EPL_CONFORMANCE_LAYOUTS`
picks others. The plain-Keras outcomes come from tests/keras_conformance/plain_baseline.json
when it was recorded with the installed keras version (`python -m keras_conformance.runner
--record`), else from a plain run first; only the tests passing plain that call `fit`,
`evaluate` or `predict` there are run routed (one calling none of them runs the same code
either way).

The assertion: every test that passes on plain Keras passes routed, except those listed
in `keras_conformance/exceptions.py` with their reason (docs/reference/keras-conformance.md
too); a listed test that now passes must leave the list (unless its outcome depends on the
random initial weights, `exceptions.SEED_DEPENDENT`). The table of routed / plain passes per
file and the failures grouped by their first error line are printed (run with `-s`).
"""

import json
import os
import tempfile
from pathlib import Path

import pytest
from keras_conformance import exceptions, runner  # tests/ is on sys.path, as for _models

LAYOUTS = tuple(os.environ.get("EPL_CONFORMANCE_LAYOUTS", "dp,pipeline").split(","))
GROUPS = tuple(
    os.environ.get("EPL_CONFORMANCE_GROUPS", f"{runner.CALLBACKS},{runner.MODELS}").split(",")
)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_keras_conformance(layout):
    directory = Path(tempfile.mkdtemp(prefix=f"keras_conformance_{layout}_"))
    report, text, path = runner.run(directory, layouts=(layout,), groups=GROUPS)
    print(text)
    print(f"\nKeras conformance report JSON: {path}")

    assert report["baseline_passed"] > 0, "no Keras test passed on plain Keras"
    data = json.loads(path.read_text())
    baseline = runner.routable(data["plain"])
    routed = data["routed"][layout]
    failing = {n for n in baseline if routed.get(n, {}).get("outcome") != "passed"}
    listed = exceptions.for_layout(layout, baseline)
    unexplained = sorted(failing - set(listed))
    assert not unexplained, (
        f"{layout}: {len(unexplained)} Keras tests pass plain but fail routed and are not "
        f"listed in keras_conformance/exceptions.py: "
        + "; ".join(f"{n}: {routed.get(n, {}).get('error', 'not run')}" for n in unexplained)
    )
    fixed = sorted(n for n in set(listed) - failing if listed[n] not in exceptions.SEED_DEPENDENT)
    assert not fixed, f"{layout}: listed as exceptions but pass routed now: {fixed}"
