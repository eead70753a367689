"""Shared by the benchmarks: measure steps in a fresh process (peak memory is process-wide
on CPU: logical devices share one allocator), and run such a measurement as a child."""

import json
import os
import subprocess
import sys
import time


def timed_peak(run, steps: int) -> dict:
    """Runs `run(steps)` after a reset of the allocator statistics.

    Returns the peak during the steps, the memory held before them ("resident": weights,
    optimizer state), their difference ("step_peak": activations and temporaries) and
    milliseconds per step. Call it after one untimed step, so tracing is not measured.
    """
    from epl_trainer.training.memory import allocator_memory, reset_peak_memory

    resident = allocator_memory()["current"]
    reset_peak_memory()
    start = time.perf_counter()
    run(steps)
    seconds = (time.perf_counter() - start) / steps
    peak = allocator_memory()["peak"]
    return {
        "peak": peak,
        "resident": resident,
        "step_peak": peak - resident,
        "step_ms": seconds * 1e3,
    }


def run_child(script: str, arguments, timeout: int = 1800) -> dict:
    """Runs `script --child <json arguments>` in a fresh Python; returns the JSON dict it
    prints last."""
    return child_result(start_child(script, arguments), timeout)


def start_child(script: str, arguments) -> subprocess.Popen:
    """Starts `script --child <json arguments>` in a fresh Python, without waiting (children
    that must run at the same time)."""
    command = [sys.executable, os.path.abspath(script), "--child", json.dumps(arguments)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(process: subprocess.Popen, timeout: int = 1800) -> dict:
    """The JSON dict a started child prints last; its error output if it failed."""
    out, err = process.communicate(timeout=timeout)
    if process.returncode:
        raise RuntimeError(f"a benchmark child exited with {process.returncode}:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def serve_child(child) -> bool:
    """When this process was started by `run_child` (`--child <json>`), prints
    `child(arguments)` as JSON and returns True; else returns False."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return True
    return False
