"""A DeepSpeed JSON config -> our `Config` and descriptions of the optimizer, batch sizes
and monitors (a `DeepSpeedSetup`: plain data; `training/deepspeed_run.py` builds the
Keras objects from it).

`DeepSpeedConfig` loads and checks the file (unknown keys are errors). `translate`
turns it into a `DeepSpeedSetup` in these steps, each a small function:

1. optimizer: `optimizer` section (or the trainer's optimizer), then `scheduler`,
   momentum cycling and `gradient_clipping` (clipped after the all-reduce, as DeepSpeed
   clips the averaged gradients);
2. precision: `fp16` / `bf16` -> `amp.*`;
3. memory: `zero_optimization` -> `zero.stage` / `offload.level`;
   `activation_checkpointing` -> `gradient_checkpoint.type`;
4. batch: `train_batch_size` & co., resolved once the data-parallel size is known
   (`DeepSpeedRun.resolve_plan`) or, when they are "auto", from `fit`'s batch size;
5. monitors: `tensorboard`, `csv_monitor`, `steps_per_print` (Keras callbacks on the
   trainer's side); `flops_profiler` -> `profiler.*` (the FLOPs profile, TFLOP/s and
   MFU in the logs).

The DeepSpeed config decides everything it has a key for (a section it lacks means
DeepSpeed's default, e.g. no fp16); the other native keys (cluster, pipeline strategy,
communication, io) come from the base config: `epl.init()`'s, or `base=`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epl_trainer.config.sections import SECTIONS, Config
from epl_trainer.deepspeed import optim
from epl_trainer.deepspeed.batch import GAS, MICRO, TRAIN
from epl_trainer.deepspeed.keys import (
    DeepSpeedConfigError,
    as_bool,
    as_float,
    as_int,
    as_str,
    check_keys,
    is_auto,
    is_off,
    require_value,
    unsupported,
)
from epl_trainer.deepspeed.setup import (
    DeepSpeedSetup,
    MonitorSpec,
    OptimizerSpec,
    TrainerOptimizer,
)

logger = logging.getLogger(__name__)

# Keys that only tune DeepSpeed's PyTorch engine (bucket sizes, overlap, pinned memory,
# memory layout): TensorFlow's runtime schedules and fuses (communication.max_splits)
# communication itself, so any value (or "auto") is accepted and changes nothing.
_ZERO_TUNING = {
    "allgather_bucket_size",
    "reduce_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "sub_group_size",
    "round_robin_gradients",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    # DeepSpeed's pydantic model accepts each field by its name as well as by its
    # `stage3_` alias (populate_by_name), and newer configs use the names: refusing them
    # as unknown made a valid config fail.
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce",
    "memory_efficient_linear",
    "override_module_apply",
}
# Keys accepted only at the value that needs no feature we lack.
_ZERO_DEFAULT_ONLY = {
    "allgather_partitions": (True, "ZeRO here always all-gathers updated partitions"),
    "reduce_scatter": (True, "ZeRO stage 2 here always reduce-scatters gradients"),
    "zero_quantized_weights": (False, "ZeRO++ quantized communication is not built"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized communication is not built"),
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning is not built"),
    "cpu_offload": (False, "use offload_optimizer: {device: cpu}"),
}
_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "fast_init", "ratio", "nvme_path"}
_OFFLOAD_PARAM_KEYS = {
    "device",
    "pin_memory",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "nvme_path",
}
_FP16_KEYS = {
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
}
_CHECKPOINTING_KEYS = {
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}
_MONITOR_KEYS = {"enabled", "output_path", "job_name"}
_FLOPS_PROFILER_KEYS = {
    "enabled",
    "recompute_fwd_factor",
    "profile_step",
    "module_depth",
    "top_modules",
    "detailed",
    "output_file",
}
_TOP_DEFAULT_ONLY = {
    "wall_clock_breakdown": (False, "forward/backward/step run as one compiled step"),
    "memory_breakdown": (False, "use trainer.memory_report()"),
    "dump_state": (False, "use trainer.config.describe()"),
    "disable_allgather": (False, "ZeRO always all-gathers updated partitions"),
}
# Accepted with any value: they choose between DeepSpeed's own kernels only.
_TOP_NO_EFFECT = {"zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"}
# DeepSpeed features we do not have: accepted only when off ({"enabled": false} etc.).
_TOP_UNSUPPORTED = {
    "wandb",
    "comet",
    "amp",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "elasticity",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "hybrid_engine",
    "comms_logger",
    "aio",
    "nebula",
    "pipeline",
    "tensor_parallel",
    "compile",
}
_TRANSLATED = {
    TRAIN,
    MICRO,
    GAS,
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "gradient_clipping",
    "activation_checkpointing",
    "steps_per_print",
    "tensorboard",
    "csv_monitor",
    "flops_profiler",
    "sparse_gradients",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "checkpoint",
    "data_types",
}
TOP_LEVEL_KEYS = frozenset(_TRANSLATED | set(_TOP_DEFAULT_ONLY) | _TOP_NO_EFFECT | _TOP_UNSUPPORTED)


def is_deepspeed_config(source: Any) -> bool:
    """Whether `source` (a DeepSpeedConfig, dict or `.json` path) is a DeepSpeed config.

    A mapping is one when a top-level key is DeepSpeed's and not a native section name
    (`optimizer` is both: DeepSpeed's has `type` / `params`).
    """
    if isinstance(source, DeepSpeedConfig):
        return True
    if isinstance(source, (str, os.PathLike)) and Path(source).suffix.lower() == ".json":
        try:
            source = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False  # the native loader reports the problem
    if not isinstance(source, Mapping):
        return False
    for key, value in source.items():
        if key in TOP_LEVEL_KEYS and key not in SECTIONS:
            return True
        if key == "optimizer" and isinstance(value, Mapping) and {"type", "params"} & set(value):
            return True
    return False


class DeepSpeedConfig:
    """A DeepSpeed config (JSON file or dict), checked key by key.

    Args:
      source: a path to a JSON file, a dict, or a DeepSpeedConfig (returned as is by `load`).
      base: the native Config the DeepSpeed keys are applied to; None uses `epl.init()`'s.
      warmup_num_steps: fills scheduler `warmup_num_steps: "auto"` (Hugging Face's
        `warmup_steps`, default 0).
      total_num_steps: fills scheduler `total_num_steps: "auto"` (Hugging Face's `max_steps`).

    Raises:
      DeepSpeedConfigError: the file cannot be read, or holds an unknown top-level key.
    """

    def __init__(
        self,
        source: Any,
        *,
        base: Config | None = None,
        warmup_num_steps: int = 0,
        total_num_steps: int | None = None,
    ):
        self.name = "<dict>"
        if isinstance(source, (str, os.PathLike)):
            self.name = os.fspath(source)
            try:
                source = json.loads(Path(source).read_text(encoding="utf-8"))
            except OSError as err:
                raise DeepSpeedConfigError(
                    f"Cannot read DeepSpeed config {self.name!r}: {err}"
                ) from err
            except ValueError as err:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config {self.name!r} is not valid JSON: {err}"
                ) from err
        if not isinstance(source, Mapping):
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.name} must be a JSON object. "
                f"Received: {type(source).__name__}"
            )
        native = [k for k in source if k not in TOP_LEVEL_KEYS and (k in SECTIONS or "." in k)]
        if native:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.name} holds EPL config keys {native}; put them in "
                "epl.init()'s config (or DeepSpeedConfig(base=...)), which the DeepSpeed keys "
                "are applied on top of."
            )
        check_keys(source, TOP_LEVEL_KEYS, f"the top level of {self.name}")
        self.values: dict[str, Any] = dict(source)
        self.base = base
        self.warmup_num_steps = as_int(warmup_num_steps, "warmup_num_steps", minimum=0)
        self.total_num_steps = (
            None if total_num_steps is None else as_int(total_num_steps, "total_num_steps")
        )

    @classmethod
    def load(cls, source: Any) -> DeepSpeedConfig:
        return source if isinstance(source, DeepSpeedConfig) else cls(source)

    def translate(
        self, trainer_optimizer: TrainerOptimizer, base: Config | None = None
    ) -> DeepSpeedSetup:
        """The trainer's pieces; "auto" values come from `trainer_optimizer` and `base`.

        Raises:
          DeepSpeedConfigError: an unknown, unsupported or invalid key or value.
        """
        base = self.base if self.base is not None else base
        if base is None:
            raise ValueError("DeepSpeedConfig.translate needs a base Config.")
        values = self.values
        _check_top_level(values)
        overrides: dict[str, Any] = {}
        overrides.update(_precision(values, base))
        overrides.update(_memory(values, base))
        communication, prescale = _communication(values, base)
        overrides.update(communication)
        overrides.update(_flops_profiler(values, base))
        overrides.update(_checkpoint_writer(values, base))
        optimizer, clip = _optimizer(values, trainer_optimizer, self)
        overrides["communication.clip_after_allreduce"] = clip is not None
        fp16 = overrides["amp.level"] == "O1" and overrides["amp.dtype"] == "float16"
        steps_per_print = as_int(values.get("steps_per_print", 10), "steps_per_print", minimum=1)
        return DeepSpeedSetup(
            config=base.replace(overrides),
            optimizer=optimizer,
            requested=tuple(_batch_value(values, key) for key in (TRAIN, MICRO, GAS)),
            monitors=_monitors(values),
            steps_per_print=steps_per_print,
            fp16=fp16,
            prescale_wire_scale=base.communication.fp16_scale if prescale else None,
        )


def _check_top_level(values: Mapping) -> None:
    for key, (accepted, why) in _TOP_DEFAULT_ONLY.items():
        require_value(values, key, (accepted,), "", why)
    for key in _TOP_UNSUPPORTED:
        if key in values and not is_off(values[key]):
            raise unsupported(key, values[key], "this DeepSpeed feature is not built")
    for key in _TOP_NO_EFFECT:
        if key in values:
            as_bool(values[key], key)
    if "bf16" in values and "bfloat16" in values:
        raise DeepSpeedConfigError("DeepSpeed config sets both 'bf16' and its alias 'bfloat16'.")
    _check_data_types(values.get("data_types"))


def _check_data_types(section) -> None:
    """`data_types.grad_accum_dtype`: gradients are accumulated in float32 here (they are
    gradients of the float32 weights, under AMP too), which is DeepSpeed's default and what
    configs write for bf16 ("grad_accum_dtype": "fp32"); that value and null are accepted,
    a reduced-precision accumulation is refused. (The whole section used to be refused as
    an unbuilt feature, so the recommended fp32 setting failed a valid config.)"""
    if section is None:
        return
    check_keys(section, {"grad_accum_dtype"}, "'data_types'")
    dtype = section.get("grad_accum_dtype")
    if dtype is not None and as_str(dtype, "data_types.grad_accum_dtype") != "fp32":
        raise unsupported(
            "data_types.grad_accum_dtype",
            dtype,
            "gradients are accumulated in float32 (accepted: 'fp32' or null)",
        )


_CHECKPOINT_KEYS = {"writer", "load_universal", "tag_validation"}
_WRITER_KEYS = {
    "type",
    "decoupled",
    "io_buffer_size",
    "io_buffer_double",
    "show_statistics",
    "data_parallel",
}


def _checkpoint_writer(values: Mapping, base: Config) -> dict:
    """checkpoint.writer.decoupled (DeepSpeed's asynchronous checkpoint engine) ->
    checkpoint.async_save. The writer's buffer sizes tune DeepSpeed's file writers; here
    TensorFlow's bundle writer writes. Every checkpoint restores into any layout, so
    `load_universal` is accepted either way; tags are always validated (the chief's names
    the folder), so `tag_validation` is accepted as "Warn" or "Fail"."""
    section = values.get("checkpoint")
    if section is None:
        return {}
    check_keys(section, _CHECKPOINT_KEYS, "'checkpoint'")
    if "load_universal" in section:
        as_bool(section["load_universal"], "checkpoint.load_universal")
    tag_validation = section.get("tag_validation", "Warn")
    if as_str(tag_validation, "checkpoint.tag_validation").upper() not in ("WARN", "FAIL"):
        raise unsupported(
            "checkpoint.tag_validation",
            tag_validation,
            "checkpoint tags are always validated (accepted: 'Warn', 'Fail')",
        )
    writer = section.get("writer") or {}
    check_keys(writer, _WRITER_KEYS, "'checkpoint.writer'")
    require_value(
        writer, "type", ("python", "fast"), "checkpoint.writer", "the 'mock' writer saves nothing"
    )
    if "decoupled" not in writer:
        return {"checkpoint.async_save": base.checkpoint.async_save}
    return {"checkpoint.async_save": as_bool(writer["decoupled"], "checkpoint.writer.decoupled")}


def _batch_value(values: Mapping, key: str) -> int | None:
    value = values.get(key)
    if value is None or is_auto(value):
        return None  # derived, or taken from fit's batch size
    return as_int(value, key)


def _enabled(section: Mapping, where: str, auto_value: bool) -> bool:
    value = section.get("enabled", False)
    return auto_value if is_auto(value) else as_bool(value, f"{where}.enabled")


def _precision(values: Mapping, base: Config) -> dict:
    """fp16 / bf16 -> amp.* ("enabled": "auto" follows the base config's amp)."""
    fp16 = values.get("fp16") or {}
    bf16 = values.get("bf16", values.get("bfloat16")) or {}
    check_keys(fp16, _FP16_KEYS, "'fp16'")
    # immediate_grad_update only chooses when DeepSpeed's BF16 optimizer moves each
    # gradient into its float32 accumulator (DeepSpeed's tests: trains identically); the
    # gradients here are float32 from the start. Refused as unknown, it failed valid configs.
    check_keys(bf16, {"enabled", "immediate_grad_update"}, "'bf16'")
    if "immediate_grad_update" in bf16:
        as_bool(bf16["immediate_grad_update"], "bf16.immediate_grad_update")
    base_amp = base.amp.level == "O1"
    fp16_on = _enabled(fp16, "fp16", base_amp and base.amp.dtype == "float16")
    bf16_on = _enabled(bf16, "bf16", base_amp and base.amp.dtype == "bfloat16")
    if fp16_on and bf16_on:
        raise DeepSpeedConfigError("DeepSpeed config enables both fp16 and bf16; choose one.")
    if bf16_on:
        return {"amp.level": "O1", "amp.dtype": "bfloat16"}
    if not fp16_on:
        # Off: every amp key back to its default. A base config's AMP tuning (its dtype,
        # loss scale) would otherwise stay set with AMP off, which the config rules refuse
        # as a key that does nothing (rules.py), naming keys this config never gave.
        if base_amp:  # the user's AMP is replaced: say so
            logger.warning(
                "The DeepSpeed config enables neither fp16 nor bf16, so training runs in "
                "float32: the base config's amp.level='O1' (amp.dtype=%r) is not used. "
                'Add "fp16" or "bf16": {"enabled": "auto"} to keep it.',
                base.amp.dtype,
            )
        return {f"amp.{field.name}": field.default for field in dataclasses.fields(base.amp)}
    require_value(fp16, "consecutive_hysteresis", (False,), "fp16", "hysteresis resets on growth")
    require_value(
        fp16, "fp16_master_weights_and_grads", (False,), "fp16", "weights stay float32 here"
    )
    # auto_cast casts the model's inputs to fp16; our AMP layers cast their inputs anyway.
    as_bool(fp16.get("auto_cast", False), "fp16.auto_cast")
    loss_scale = as_float(fp16.get("loss_scale", 0), "fp16.loss_scale", minimum=0.0)
    return {
        "amp.level": "O1",
        "amp.dtype": "float16",
        "amp.loss_scale": "dynamic" if loss_scale == 0 else loss_scale,
        "amp.initial_scale_power": as_int(
            fp16.get("initial_scale_power", 16), "fp16.initial_scale_power", minimum=0
        ),
        "amp.loss_scale_window": as_int(
            fp16.get("loss_scale_window", 1000), "fp16.loss_scale_window", minimum=1
        ),
        "amp.hysteresis": as_int(fp16.get("hysteresis", 2), "fp16.hysteresis", minimum=1),
        "amp.min_loss_scale": as_float(fp16.get("min_loss_scale", 1), "fp16.min_loss_scale"),
    }


def _memory(values: Mapping, base: Config) -> dict:
    """zero_optimization -> zero.stage / offload.level; activation_checkpointing -> recompute."""
    zero = values.get("zero_optimization") or {}
    check_keys(
        zero,
        {"stage", "offload_optimizer", "offload_param"} | _ZERO_TUNING | set(_ZERO_DEFAULT_ONLY),
        "'zero_optimization'",
    )
    stage = as_int(zero.get("stage", 0), "zero_optimization.stage", minimum=0)
    if stage > 3:
        raise DeepSpeedConfigError(
            f"DeepSpeed config zero_optimization.stage must be 0-3. Received: {stage}"
        )
    for key, (accepted, why) in _ZERO_DEFAULT_ONLY.items():
        require_value(zero, key, (accepted,), "zero_optimization", why)
    param_device = (
        _offload_device(zero, "offload_param", _OFFLOAD_PARAM_KEYS)
        if zero.get("offload_param")
        else "none"
    )
    if param_device != "none" and stage != 3:
        raise DeepSpeedConfigError(
            "DeepSpeed config zero_optimization.offload_param is only valid with ZeRO stage 3 "
            f"(as in DeepSpeed). Received: stage={stage}"
        )
    device = (
        _offload_device(zero, "offload_optimizer", _OFFLOAD_KEYS)
        if "offload_optimizer" in zero
        else "none"
    )
    out = {"zero.stage": stage, "offload.level": ""}
    if "cpu" in (device, param_device):
        if stage == 0:
            raise DeepSpeedConfigError(
                "DeepSpeed config zero_optimization.offload_optimizer needs stage 1, 2 or 3 "
                "(as in DeepSpeed). Received: stage=0"
            )
        # ZeRO-Offload: the partitions stay (zero.stage), their optimizer state and
        # update move to the worker's host (offload.level), which holds its lanes' shards.
        # Under stage 3 the shards are the parameters too: offload_optimizer and
        # offload_param both put parameters and optimizer state on the host.
        logger.info(
            "ZeRO stage %d + offload %s cpu -> zero.stage=%d, offload.level='v0' (each "
            "replica's %s shard and its update on the worker's host).",
            stage,
            "/".join(k for k, d in (("optimizer", device), ("param", param_device)) if d == "cpu"),
            stage,
            "parameter and optimizer" if stage == 3 else "optimizer",
        )
        out["offload.level"] = "v0"
    out.update(_checkpointing(values, base))
    return out


def _communication(values: Mapping, base: Config) -> tuple[dict, bool]:
    """sparse_gradients, communication_data_type, prescale_gradients and
    gradient_predivide_factor -> communication.*; and whether the float16 wire's scale is
    still to be divided by the data-parallel size (prescale_gradients, in resolve_plan).

    DeepSpeed's prescale / predivide only choose where the mean's 1/N is applied (before
    or around the sum): the result is the mean either way. On a float32 reduction that
    changes nothing but rounding; on the float16 wire (`communication.fp16`, whose values
    cross multiplied by `fp16_scale`) it is what keeps the sum from overflowing, so there
    the factor divides the wire's scale.
    """
    out: dict[str, Any] = {}
    if "sparse_gradients" in values:
        # DeepSpeed's default (false) reduces Embedding gradients as dense tables; true
        # gathers their rows, which is the engine's default (sparse_as_dense=False).
        sparse = as_bool(values["sparse_gradients"], "sparse_gradients")
        out["communication.sparse_as_dense"] = not sparse
    wire = values.get("communication_data_type")
    if wire is not None:
        wire = as_str(wire, "communication_data_type", choices=("fp16", "bf16", "fp32"))
        if wire == "bf16":
            raise unsupported(
                "communication_data_type",
                wire,
                "the reduced-precision gradient wire is float16 only (communication.fp16); "
                "use 'fp16' or 'fp32'",
            )
        out["communication.fp16"] = wire == "fp16"
    prescale = as_bool(values.get("prescale_gradients", False), "prescale_gradients")
    predivide = as_float(
        values.get("gradient_predivide_factor", 1.0), "gradient_predivide_factor", minimum=0.0
    )
    if predivide == 0.0:
        raise DeepSpeedConfigError("DeepSpeed config gradient_predivide_factor must be > 0.")
    if prescale and predivide != 1.0:
        raise DeepSpeedConfigError(
            "DeepSpeed applies gradient_predivide_factor only without prescale_gradients "
            "(prescaling divides by the data-parallel size instead); give one of them. "
            f"Received: prescale_gradients=True, gradient_predivide_factor={predivide}"
        )
    fp16_wire = out.get("communication.fp16", base.communication.fp16)
    if fp16_wire and predivide != 1.0:
        out["communication.fp16_scale"] = base.communication.fp16_scale / predivide
    elif (prescale or predivide != 1.0) and not fp16_wire:
        logger.info(
            "prescale_gradients / gradient_predivide_factor: gradients are reduced in "
            "float32, where the mean is the same wherever 1/N is applied."
        )
    return out, prescale and fp16_wire


def _offload_device(zero: Mapping, key: str, known) -> str:
    section = zero.get(key) or {}
    where = f"zero_optimization.{key}"
    check_keys(section, known, f"'{where}'")
    device = as_str(
        section.get("device", "none"), f"{where}.device", choices=("none", "cpu", "nvme")
    )
    if device == "nvme":
        raise unsupported(f"{where}.device", device, "NVMe offload is not built; use 'cpu'")
    require_value(section, "ratio", (1, 1.0), where, "partial offload is not built")
    return device


def _checkpointing(values: Mapping, base: Config) -> dict:
    if "activation_checkpointing" not in values:
        return {"gradient_checkpoint.type": ""}
    section = values["activation_checkpointing"] or {}
    check_keys(section, _CHECKPOINTING_KEYS, "'activation_checkpointing'")
    where = "activation_checkpointing"
    require_value(
        section,
        "partition_activations",
        (False,),
        where,
        "there is no model parallelism to partition over",
    )
    require_value(
        section, "cpu_checkpointing", (False,), where, "checkpoints stay on the stage device"
    )
    require_value(
        section, "contiguous_memory_optimization", (False,), where, "TensorFlow owns the buffers"
    )
    require_value(section, "profile", (False,), where, "use the TensorBoard profiler")
    # DeepSpeed checkpoints the functions a model wraps in checkpointing.checkpoint(); the
    # Keras equivalent is marking tensors (type "collection", set in the base config), and
    # otherwise the automatic choice of segments.
    return {"gradient_checkpoint.type": base.gradient_checkpoint.type or "auto"}


def _optimizer(
    values: Mapping, trainer: TrainerOptimizer, ds: DeepSpeedConfig
) -> tuple[OptimizerSpec, float | None]:
    """(the optimizer, clip norm or None) from optimizer, scheduler and gradient_clipping."""
    if "optimizer" in values:
        optimizer, lr = optim.build_optimizer(values["optimizer"], trainer)
    else:
        optimizer = OptimizerSpec(rule=None)  # the trainer's own
        # Read only if a scheduler needs it: a trainer optimizer whose rate is a Keras
        # schedule is refused there, not for every config without an optimizer section
        # (that failed configs with no scheduler, or one given every value).
        lr = functools.partial(optim.trainer_value, trainer, "lr", "scheduler (learning rate)")
    schedule = None
    if "scheduler" in values:
        schedule = optim.build_schedule(
            values["scheduler"],
            lr,
            warmup_num_steps=ds.warmup_num_steps,
            total_num_steps=ds.total_num_steps,
        )
    clip = values.get("gradient_clipping", 0.0)
    if "gradient_clipping" not in values and trainer.global_clipnorm:
        logger.warning(
            "The DeepSpeed config has no gradient_clipping (DeepSpeed's default: no clipping), "
            'so the optimizer\'s global_clipnorm=%s is not used; set "gradient_clipping": '
            '"auto" to keep it.',
            trainer.global_clipnorm,
        )
    if is_auto(clip):
        clip = trainer.global_clipnorm or 0.0  # Hugging Face's max_grad_norm
    clip = as_float(clip, "gradient_clipping", minimum=0.0) or None
    return dataclasses.replace(optimizer, schedule=schedule, global_clipnorm=clip), clip


def _monitors(values: Mapping) -> tuple[MonitorSpec, ...]:
    specs = []
    for kind in ("tensorboard", "csv_monitor"):
        section = values.get(kind) or {}
        check_keys(section, _MONITOR_KEYS, f"'{kind}'")
        if as_bool(section.get("enabled", False), f"{kind}.enabled"):
            output_path = as_str(section.get("output_path", ""), f"{kind}.output_path")
            job_name = as_str(section.get("job_name", "DeepSpeedJobName"), f"{kind}.job_name")
            specs.append(MonitorSpec(kind, output_path, job_name))
    return tuple(specs)


def _flops_profiler(values: Mapping, base: Config) -> dict:
    """flops_profiler -> profiler.* ("enabled": "auto" follows the base config)."""
    section = values.get("flops_profiler") or {}
    check_keys(section, _FLOPS_PROFILER_KEYS, "'flops_profiler'")
    if not _enabled(section, "flops_profiler", base.profiler.flops):
        return {"profiler.flops": False}
    where = "flops_profiler"
    why = "MFU here counts the model's FLOPs; a recomputed forward adds time, not model FLOPs"
    require_value(section, "recompute_fwd_factor", (0,), where, why)
    output_file = section.get("output_file") or ""  # DeepSpeed's null: stdout
    return {
        "profiler.flops": True,
        "profiler.profile_step": as_int(
            section.get("profile_step", 1), f"{where}.profile_step", minimum=-1
        ),
        "profiler.module_depth": as_int(
            section.get("module_depth", -1), f"{where}.module_depth", minimum=-1
        ),
        "profiler.top_modules": as_int(
            section.get("top_modules", 1), f"{where}.top_modules", minimum=1
        ),
        "profiler.detailed": as_bool(section.get("detailed", True), f"{where}.detailed"),
        "profiler.output_file": as_str(output_file, f"{where}.output_file"),
    }
