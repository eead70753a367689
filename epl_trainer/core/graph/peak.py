"""The machine's float32 matmul peak (MFU's denominator), measured once and cached.

`matmul_peak()` times square float32 matmuls on the CPU with every core (a fresh Python
process, so the caller's thread pools and logical devices do not limit it), keeps the
best of a few (well under a second), and caches the result in
`~/.cache/epl_trainer/matmul_peak.json` (`$XDG_CACHE_HOME` if set), keyed by the CPU
model, the cores this process may use, the TensorFlow version and whether oneDNN is on
(`TF_ENABLE_ONEDNN_OPTS` changes CPU matmul speed a lot, and its default differs by CPU).
A known accelerator peak replaces the measurement: `profiler.peak_tflops` in the config
(or `EPL_PROFILER_PEAK_TFLOPS`), passed here as `override_tflops`.

`model_flops_utilization` divides and refuses a ratio above 1: the FLOP count or the peak
is wrong then, and a number above 100% must not be shown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_FILE = "matmul_peak.json"
_SIZE = 2048  # 17 GFLOP per matmul: long enough on a CPU that the clock's resolution is noise
_REPEATS = 4


@dataclasses.dataclass(frozen=True)
class Peak:
    """A peak rate and where it came from ("measured", "cached" or "config")."""

    flops_per_second: float
    source: str
    machine: str

    @property
    def tflops(self) -> float:
        return self.flops_per_second / 1e12

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s ({self.source}; {self.machine})"


class UtilizationError(ValueError):
    """A measured MFU above 1: the FLOP count or the peak is wrong."""


def model_flops_utilization(flops: float, seconds: float, peak: Peak, workers: int = 1) -> float:
    """flops / seconds / (peak x workers), in [0, 1]: `flops` of the whole job's step and
    `peak` of one worker's machine (every worker on a machine like it).

    Raises:
      UtilizationError: the ratio is above 1 (more FLOPs per second than the peak allows).
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0. Received: seconds={seconds}")
    ratio = flops / seconds / (peak.flops_per_second * workers)
    if ratio > 1.0:
        raise UtilizationError(
            f"Measured MFU {ratio:.1%} is above 100%: the FLOP count or the peak is wrong. "
            f"Received: flops={flops:.4g} in {seconds:.4g} s = {flops / seconds:.4g} FLOP/s, "
            f"peak={peak.describe()} x workers={workers}. A peak measured while the machine "
            "was busy is too low: delete "
            f"{cache_path()} to measure again, or set profiler.peak_tflops."
        )
    return ratio


def machine_key() -> dict:
    """What the cached peak is valid for."""
    import tensorflow as tf

    return {
        "cpu": _cpu_model(),
        "cores": _usable_cores(),
        "tensorflow": tf.__version__,
        "onednn": onednn_enabled(),
    }


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "epl_trainer" / CACHE_FILE


def matmul_peak(
    override_tflops: float | None = None, *, cache_file: str | os.PathLike | None = None
) -> Peak:
    """The float32 matmul peak of this machine: `override_tflops` if given (> 0), else
    the cached measurement for this machine key, else a new measurement (then cached)."""
    key = machine_key()
    machine = _describe(key)
    if override_tflops:
        if override_tflops < 0:
            raise ValueError(f"The peak must be > 0 TFLOP/s. Received: {override_tflops}")
        return Peak(override_tflops * 1e12, "config", machine)
    path = Path(cache_file) if cache_file is not None else cache_path()
    entries = _read(path)
    name = json.dumps(key, sort_keys=True)
    if name in entries:
        return Peak(float(entries[name]["flops_per_second"]), "cached", machine)
    rate = measure_in_fresh_process()
    entries[name] = {"flops_per_second": rate, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(path, entries)
    return Peak(rate, "measured", machine)


def measure_in_fresh_process(timeout: float = 120) -> float:
    """`measure_matmul_rate` in a child Python with TensorFlow's default thread pools (all
    cores) and the same environment (so the same oneDNN setting)."""
    # This file run as a script: it imports nothing of the package (fast, no side effects).
    command = [sys.executable, os.path.abspath(__file__)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)  # a plain process: no cluster to join
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if done.returncode:
        raise RuntimeError(f"The matmul peak benchmark failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measure_matmul_rate(size: int = _SIZE, repeats: int = _REPEATS) -> float:
    """FLOP/s of the fastest of `repeats` float32 [size, size] matmuls (after a warm-up)."""
    import tensorflow as tf

    with tf.device("/cpu:0"):
        a = tf.random.normal((size, size), dtype=tf.float32)
        b = tf.random.normal((size, size), dtype=tf.float32)
        tf.linalg.matmul(a, b).numpy()  # warm-up: thread pools, oneDNN's kernels
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            tf.linalg.matmul(a, b).numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def onednn_enabled() -> bool:
    """Whether this TensorFlow runs oneDNN kernels (as it decided at import)."""
    try:  # the flag TensorFlow itself reads; private, hence the fallback
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        value = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "")
        return value.strip().lower() not in ("0", "false", "off", "no")


def _describe(key: dict) -> str:
    onednn = "oneDNN on" if key["onednn"] else "oneDNN off"
    return f"{key['cpu']}, {key['cores']} cores, TF {key['tensorflow']}, {onednn}"


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # absent or damaged: measured again
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict) -> None:
    """Atomically (concurrent workers of one machine may measure at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".peak-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(temporary, path)


if __name__ == "__main__":
    print(measure_matmul_rate())
