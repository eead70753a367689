"""Keras conformance harness (issue #28, item 1): Keras's own tests, run on plain Keras and
with `Model.fit` / `evaluate` / `predict` routed through `EPLTrainer`.

- `runner.py`: selects and copies the Keras test files, runs pytest in a subprocess per
  layout, compares, prints and saves the report (used by tests/test_keras_conformance.py).
- `plugin.py`: the pytest plugin (`-p keras_conformance.plugin`) loaded into that
  subprocess: registers Keras's markers, records every test's outcome, keeps only the
  tests given, and for a routed layout configures the devices and installs `routing.py`.
- `routing.py`: the monkeypatches of `keras.Model.fit` / `evaluate` / `predict`.
"""
