"""Keras conformance harness (issue #28, item 1; issue #45, item 9): Keras's own tests, run on
plain Keras and with `fit` / `evaluate` / `predict` routed through `EPLTrainer`.

- `runner.py`: selects and copies the Keras test files, runs pytest in a subprocess per
  layout, compares, prints and saves the report (used by tests/test_keras_conformance.py).
- `plugin.py`: the pytest plugin (`-p keras_conformance.plugin`) loaded into that
  subprocess: registers Keras's markers, records every test's outcome and failure text,
  keeps only the tests given, and for a routed layout configures the devices and
  installs `routing.py`.
- `routing.py`: the patches of Keras's `fit` / `evaluate` / `predict`.
- `exceptions.py`: the tests listed as failing routed (with the message they must fail
  with) or as passing without a routed call, with their reasons.
- `verdict.py`: each routed test's count (routed, unrouted, listed, failed) and every
  disagreement with the lists.
"""
