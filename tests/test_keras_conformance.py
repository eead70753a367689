"""Keras conformance (issue #28, item 1): Keras's own callback tests (and, on demand, its
model tests) run on plain Keras, then with `keras.Model.fit` / `evaluate` / `predict`
routed through `EPLTrainer` on 2 logical CPU devices (tests/keras_conformance/).

Each run is a fresh pytest subprocess on copies of the installed wheel's test files:
plain first (the baseline: tests failing on plain Keras here, e.g. orbax without its
package, are left out), then each layout on plain's passes only. The table of routed /
plain passes per file, the failing tests grouped by their first error line and the JSON
path of the full results are printed (run with `-s`).

Layouts: "dp" (`cluster.virtual_devices: 2`, data parallel) runs by default; "pipeline"
(auto.auto_parallel, 2 stages, 2 micro-batches) only with
`EPL_CONFORMANCE_LAYOUTS=dp,pipeline`, since plain + dp already take ~4 minutes on 2
cores (measured: plain 128-192 s, dp 109-155 s, pipeline 136 s; the higher figures with
another test run on the machine).
Files: `keras/src/callbacks/*_test.py` calling `fit` by default; add
`keras/src/models/model_test.py` with `EPL_CONFORMANCE_GROUPS=callbacks,models` (plain
model_test alone takes ~60 s more; it has no ratchet baseline yet).

The assertion is a ratchet: routed passes per layout and group must not fall below
`BASELINE` (raise it when a fix makes more pass), and every baseline test must have a
routed outcome.
"""

import json
import os
import tempfile
from pathlib import Path

import pytest
from keras_conformance import runner  # tests/ is on sys.path, as for _models

LAYOUTS = tuple(os.environ.get("EPL_CONFORMANCE_LAYOUTS", "dp").split(","))
GROUPS = tuple(os.environ.get("EPL_CONFORMANCE_GROUPS", runner.CALLBACKS).split(","))

# Routed passes measured with keras 3.15.1 / TF 2.21 (of 66 callback tests passing plain).
BASELINE = {
    ("dp", runner.CALLBACKS): 36,
    ("pipeline", runner.CALLBACKS): 31,
}

# Seconds: ~200 s per run measured on a busy 2-core machine, with a margin.
TIMEOUT = 400 * (1 + len(LAYOUTS)) * (2 if runner.MODELS in GROUPS else 1)


def _group(file_name: str) -> str:
    return runner.MODELS if file_name in runner.MODEL_FILES else runner.CALLBACKS


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_keras_conformance():
    directory = Path(tempfile.mkdtemp(prefix="keras_conformance_"))
    report, text, path = runner.run(directory, layouts=LAYOUTS, groups=GROUPS)
    print(text)
    print(f"\nKeras conformance report JSON: {path}")

    assert report["baseline_passed"] > 0, "no Keras test passed on plain Keras"
    data = json.loads(path.read_text())
    baseline_nodes = [n for n, r in data["plain"].items() if r["outcome"] == "passed"]
    for layout in LAYOUTS:
        summary = report["layouts"][layout]
        assert summary["counted"] == report["baseline_passed"]
        missing = [n for n in baseline_nodes if n not in data["routed"][layout]]
        assert not missing, f"{layout}: baseline tests without a routed outcome: {missing}"
        for group in GROUPS:
            passed = sum(
                entry["routed"]
                for name, entry in summary["per_file"].items()
                if _group(name) == group
            )
            floor = BASELINE.get((layout, group))
            if floor is not None:
                assert passed >= floor, (
                    f"{layout}/{group}: {passed} Keras tests pass routed, fewer than the "
                    f"recorded {floor} (see the failures above)"
                )
