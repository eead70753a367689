"""The `profiler` config section: FLOPs, TFLOP/s and MFU of training (DeepSpeed's
`flops_profiler` keys, translated by epl_trainer/deepspeed/translate.py, map onto it).

Its own module (sections.py is at the file-size cap); `epl_trainer/config/__init__.py`
imports it, so the section is registered wherever the config is.
"""

from __future__ import annotations

import dataclasses

from epl_trainer.config.keys import Kind, _bool, _int, _key, _str
from epl_trainer.config.sections import _register, _Section


@_register("profiler")
@dataclasses.dataclass(frozen=True)
class ProfilerConfig(_Section):
    """FLOPs of a training step and the share of the machine's peak it reaches."""

    flops: bool = _bool(False, "Log tflops and mfu while training; print the FLOPs profile.")
    profile_step: int = _int(1, "Step whose FLOPs profile is printed (-1: none).", minimum=-1)
    module_depth: int = _int(-1, "Layer depth of the profile (-1: the deepest).", minimum=-1)
    top_modules: int = _int(1, "Layers the profile names at each depth.", minimum=1)
    detailed: bool = _bool(True, "The profile lists every layer at module_depth.")
    output_file: str = _str("", "File the profile is written to ('' = stdout).")
    peak_tflops: int | float = _key(
        0,
        "Peak TFLOP/s of one worker, all its devices (0: measure the CPU's float32 matmuls).",
        kind=Kind.NUMBER,
        minimum=0,
    )
