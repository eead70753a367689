"""Shared by the tests that measure a step's memory: a step's peak above the memory held
before it, and a test file rerun as a fresh process (its own TensorFlow, threads and
allocator)."""

import json
import os
import subprocess
import sys


def median_step_peak(trainer, x, y, steps: int = 5) -> int:
    """The median over `steps` train_on_batch calls of the allocator's peak above the
    memory held before the step: the process's (on CPU the logical devices share one
    allocator); the median, as a step now and then overlaps differently."""
    import numpy as np

    from epl_trainer.training.memory import allocator_memory, reset_peak_memory

    peaks = []
    for _ in range(steps):
        reset_peak_memory()
        base = allocator_memory()["current"]
        trainer.train_on_batch(x, y)
        peaks.append(allocator_memory()["peak"] - base)
    return int(np.median(peaks))


def run_fresh(script: str, *args):
    """The JSON that `python script *args` prints last, run in a fresh process."""
    out = subprocess.run(
        [sys.executable, script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
