"""The default EPL config of `python -m model_zoo.bert_squad` (kept apart from its flags
so tests can import it without defining absl flags)."""

from __future__ import annotations

import os

# Without --epl_config the run is configs/bert_squad_pipeline.json (a test keeps these
# equal). They are environment defaults, the config's lowest-precedence source, so
# --epl_set and epl-launch's device count still override them; a recipe given with
# --epl_config replaces them, except the 2 simulated devices (as in the quickstart).
DEFAULT_CONFIG = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 4}


def environ_with_defaults(epl_config: str | None, environ=None) -> dict[str, str]:
    """`environ` (default `os.environ`) plus the run's defaults where it has none."""
    environ = dict(os.environ if environ is None else environ)
    defaults = DEFAULT_CONFIG if not epl_config else {"cluster.virtual_devices": 2}
    for key, value in defaults.items():
        environ.setdefault("EPL_" + key.replace(".", "_").upper(), str(value))
    return environ
