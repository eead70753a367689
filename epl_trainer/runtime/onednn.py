"""oneDNN's CPU kernels on, unless the user chose (`TF_ENABLE_ONEDNN_OPTS`).

TensorFlow turns oneDNN on by default only on some CPUs (those with AVX-512's neural
network extensions); elsewhere it leaves it off, and every step is several times slower,
Keras's too (docs/benchmarks.md#onednn-on-and-off). TensorFlow reads the variable once,
when it is imported, so the package sets it at its own import (`epl_trainer/__init__.py`),
before TensorFlow loads, and `epl.init()` says what it did, or what to do when
TensorFlow came first without it.
"""

from __future__ import annotations

import os
import sys

ENV = "TF_ENABLE_ONEDNN_OPTS"
_set_by_us = False
_noticed = False


def choose_default(environ=os.environ, modules=sys.modules) -> bool:
    """Sets `TF_ENABLE_ONEDNN_OPTS=1` when the user has not chosen and TensorFlow is not
    imported yet (so it still reads it). Returns whether it did."""
    global _set_by_us
    if ENV in environ or "tensorflow" in modules:
        return False
    environ[ENV] = "1"
    _set_by_us = True
    return True


def notice(enabled: bool, environ=os.environ) -> str | None:
    """The line `epl.init()` prints, once per process: the choice made and why, advice
    when TensorFlow runs without oneDNN though nobody chose that, or None (the user
    chose, or it was said already)."""
    global _noticed
    if _noticed:
        return None
    _noticed = True
    if _set_by_us:
        return (
            f"epl_trainer: {ENV} was unset, so it is 1 (oneDNN's CPU kernels: 2-4x faster "
            "steps measured where TensorFlow's default leaves them off); set it to 0 to keep "
            "TensorFlow's choice."
        )
    if ENV not in environ and not enabled:
        return (
            "epl_trainer: TensorFlow was imported before epl_trainer and runs without "
            f"oneDNN's CPU kernels on this CPU: set {ENV}=1 (or import epl_trainer first) "
            "for 2-4x faster steps (measured)."
        )
    return None
