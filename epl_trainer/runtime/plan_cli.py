"""epl-plan: the Plan and per-device memory / traffic of a job, for clusters you do not have.

    epl-plan --model bert --size large --num_workers 64 --gpu_per_worker 8 \\
        --num_stages 4 --num_micro_batch 8 --micro_batch_size 4 --zero v1 --amp O1 --gc
    epl-plan --params 7.5e9 --num_workers 8 --gpu_per_worker 8 --amp master --zero v0
    epl-plan --layout_map llama --layers 32 --hidden 4096 --heads 32 --ffn 11008 \\
        --vocab 32000 --mesh 2,4

Nothing is built or run and TensorFlow is never imported: the model comes from its sizes
(`core/plan/analytic.py`), the cluster is a list of virtual device names planned by the same
planner the trainer uses, and the numbers are `core/plan/estimate.py`'s arithmetic. Stages
are cut by `estimate.partition_stages`, as `auto.auto_parallel` cuts them. Settings not
given as flags come from `--epl_config` / `--epl_set` / `EPL_*` (the trainer's config
keys), then from the defaults. `--layout_map` is the exception: it asks KerasHub for its
family's layout map (`runtime/kerashub_maps.py`), which imports Keras and its backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys

from epl_trainer.config.sections import Config, ConfigError
from epl_trainer.core.plan import (
    analytic,
    devices,
    estimate,
    kerashub_layouts,
    planner,
    search,
    step_time,
)
from epl_trainer.core.plan.ir import (
    INTERLEAVED,
    PIPELINE_STRATEGIES,
    PlanError,
    StrategySpec,
    format_count,
)
from epl_trainer.core.plan.schedule import device_peak_in_flight, make_schedule
from epl_trainer.runtime import kerashub_maps

MODELS = ("transformer", "bert", "resnet50")
_TRANSFORMER_SIZES = ("layers", "hidden", "heads", "vocab", "seq_len")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epl-plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Byte counts use decimal units (GB = 1e9 bytes), as the ZeRO paper does.",
    )
    model = parser.add_argument_group("model (one of --model or --params)")
    model.add_argument("--model", choices=MODELS, help="a zoo model or a described transformer")
    model.add_argument(
        "--params", type=float, help="only a parameter count: model states, no activations"
    )
    model.add_argument("--size", help=f"BERT size: {list(analytic.BERT_SIZES)} (default base)")
    for name in (*_TRANSFORMER_SIZES, "ffn"):
        model.add_argument(f"--{name}", type=int, help=f"transformer {name}")
    model.add_argument("--max_position", type=int, help="position embeddings (default seq_len)")
    model.add_argument("--head", choices=analytic.HEADS, help="transformer head (default lm)")
    model.add_argument("--activation", choices=("gelu", "gelu_tanh", "relu"), help="(default gelu)")
    model.add_argument("--num_classes", type=int, help="pool head / ResNet classes")
    model.add_argument("--image_size", type=int, help="ResNet input size (default 224)")

    cluster = parser.add_argument_group("virtual cluster")
    cluster.add_argument("--num_workers", type=int, default=1)
    cluster.add_argument("--gpu_per_worker", type=int, default=1)
    cluster.add_argument("--device_type", default="GPU", help="device names' type (display)")
    cluster.add_argument("--device_memory", help="bytes per device, e.g. 32GB or 80GiB")
    cluster.add_argument(
        "--device",
        choices=sorted(devices.DEVICES),
        help="a known device (core/plan/devices.py: peak, memory, links) for the step time, "
        "throughput and MFU; --peak_tflops / --device_memory replace its values",
    )

    parallel = parser.add_argument_group(
        "parallelism (default: --epl_config / --epl_set / EPL_* config keys)"
    )
    parallel.add_argument("--num_stages", type=int, help="pipeline.num_stages (default 1)")
    parallel.add_argument(
        "--tensor_parallel",
        type=int,
        default=1,
        help="devices per tensor group (Megatron's column / row split of transformer layers, "
        "a keras.distribution mesh's model axis); divides --gpu_per_worker",
    )
    parallel.add_argument("--num_micro_batch", type=int, help="pipeline.num_micro_batch")
    parallel.add_argument("--micro_batch_size", type=int, default=1, help="samples per micro-batch")
    parallel.add_argument(
        "--pipeline_strategy", choices=PIPELINE_STRATEGIES, help="pipeline.strategy"
    )
    parallel.add_argument(
        "--virtual_stages",
        type=int,
        help="pipeline.virtual_stages: stages per device with Interleaved1F1B (--num_stages "
        "counts all of them); the schedule comparison uses it (default 2) for Interleaved1F1B",
    )
    parallel.add_argument(
        "--zero",
        choices=("none", "v0", "v1", "v2"),
        help="zero.level (DeepSpeed's zero.stage 1/2/3): v0 = P_os, v1 = P_os+g, v2 = P_os+g+p",
    )
    parallel.add_argument(
        "--amp",
        nargs="?",
        const="O1",
        choices=("none", "O1", "master"),
        help="O1 (amp.level: float32 weights cast on use, 16-bit activations) or master "
        "(the ZeRO paper's / DeepSpeed's 16-bit weights and gradients + float32 master copy)",
    )
    parallel.add_argument(
        "--gc",
        action=argparse.BooleanOptionalAction,
        help="gradient checkpointing (gradient_checkpoint.type)",
    )
    parallel.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        help="model states in host memory (offload.level v0)",
    )
    parallel.add_argument("--optimizer", default="adam", choices=tuple(estimate.OPTIMIZER_SLOTS))
    parallel.add_argument("--epl_config", help="a JSON/YAML config file of the trainer")
    parallel.add_argument("--epl_set", action="append", default=[], help="KEY=VALUE, repeatable")
    parallel.add_argument(
        "--peak_tflops",
        type=float,
        help="one worker's peak TFLOP/s, for the step time at 100%% MFU (profiler.peak_tflops)",
    )
    search = parser.add_argument_group("layout search")
    search.add_argument(
        "--search",
        action="store_true",
        help="search data / tensor / pipeline degrees, micro-batches, schedule, ZeRO, gc and "
        "offload for the fastest layouts that fit the device memory",
    )
    search.add_argument(
        "--global_batch", type=int, help="samples per step for --search (default: the plan's)"
    )
    search.add_argument("--top", type=int, default=5, help="layouts --search prints")
    search.add_argument(
        "--save_config", help="write the best layout's config keys to this JSON file"
    )
    layouts = parser.add_argument_group(
        "KerasHub layout map (instead of --model / --params: what each device holds)"
    )
    layouts.add_argument(
        "--layout_map",
        choices=sorted(kerashub_layouts.FAMILIES),
        help="a KerasHub family described by --layers --hidden --heads --ffn (its "
        "intermediate_dim) --vocab [--kv_heads --head_dim --tie_embeddings], laid out by its "
        "own <Family>Backbone.get_layout_map (imports keras and keras_hub)",
    )
    layouts.add_argument(
        "--mesh", type=_mesh_shape, help="the DeviceMesh's (batch, model) sizes, e.g. 2,4"
    )
    layouts.add_argument("--kv_heads", type=int, help="num_key_value_heads (default --heads)")
    layouts.add_argument("--head_dim", type=int, help="Gemma's head_dim")
    layouts.add_argument(
        "--tie_embeddings",
        action=argparse.BooleanOptionalAction,
        help="tie_word_embeddings (default: the family's; Gemma always ties)",
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return parser


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        shape = tuple(int(n) for n in text.split(","))
        return kerashub_layouts.check_mesh(shape)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a mesh is its (batch, model) sizes, e.g. 2,4. Received: {text!r}"
        ) from None


# Which model flags each model takes (the others would be silently ignored: refused).
_MODEL_FLAGS = {
    "params": set(),
    "bert": {"size", "seq_len", "vocab"},
    "resnet50": {"image_size", "num_classes"},
    "transformer": {*_TRANSFORMER_SIZES, "ffn", "max_position", "head", "activation"}
    | {"num_classes"},
}


def model_from_args(args, parser) -> estimate.ModelCost:
    """The `ModelCost` the flags describe."""
    if (args.model is None) == (args.params is None):
        parser.error("give exactly one of --model or --params")
    kind = args.model or "params"
    given = {flag for flags in _MODEL_FLAGS.values() for flag in flags}
    given = {flag for flag in given if getattr(args, flag) is not None}
    unused = sorted(given - _MODEL_FLAGS[kind])
    if unused:
        what = f"--model {kind}" if args.model else "--params"
        parser.error(f"{what} does not take {' '.join('--' + f for f in unused)}")
    if kind == "params":
        return analytic.params_only(args.params)
    if kind == "bert":
        return analytic.bert(args.size or "base", seq_len=args.seq_len, vocab=args.vocab or 30522)
    if kind == "resnet50":
        return analytic.resnet50(args.image_size or 224, args.num_classes or 1000)
    missing = [f"--{n}" for n in _TRANSFORMER_SIZES if getattr(args, n) is None]
    if missing:
        parser.error(f"--model transformer needs {' '.join(missing)}")
    return analytic.transformer(
        args.layers,
        args.hidden,
        args.heads,
        args.vocab,
        args.seq_len,
        args.ffn,
        max_position=args.max_position,
        head=args.head or "lm",
        num_classes=args.num_classes or 2,
        activation=args.activation or "gelu",
    )


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """How to lay the model out: what `build_plan` needs besides the cluster."""

    num_stages: int = 1
    num_micro_batch: int = 1  # pipeline.num_micro_batch
    pipeline_strategy: str = "PreferBackward"  # pipeline.strategy
    virtual_stages: int = 1  # pipeline.virtual_stages
    tensor_parallel: int = 1  # devices per tensor group
    offload: bool = False  # offload.level v0
    prefer_intra_node: bool = True  # cluster.device_place_prefer_intra_node
    peak_tflops: float = 0.0  # profiler.peak_tflops: one worker's peak; 0 = not known


def options_from_args(args) -> tuple[estimate.TrainOptions, PlanRequest]:
    """(options, request): flags first, then the config."""
    from epl_trainer.runtime.flags import parse_assignments  # absl only, no TensorFlow

    overrides = parse_assignments(args.epl_set)
    config = (
        Config.from_file(os.path.expanduser(args.epl_config), overrides)
        if args.epl_config
        else Config(overrides)
    )

    def pick(flag, default):
        return default if flag is None else flag

    amp = pick(args.amp, config.amp.level)
    options = estimate.TrainOptions(
        micro_batch_size=args.micro_batch_size,
        zero=pick(args.zero, config.zero.level).replace("none", ""),
        amp=amp.replace("none", ""),
        gc=pick(args.gc, bool(config.gradient_checkpoint.type)),
        optimizer=args.optimizer,
    )
    request = PlanRequest(
        num_stages=pick(args.num_stages, config.pipeline.num_stages or 1),
        num_micro_batch=pick(args.num_micro_batch, config.pipeline.num_micro_batch),
        pipeline_strategy=pick(args.pipeline_strategy, config.pipeline.strategy),
        virtual_stages=pick(args.virtual_stages, config.pipeline.virtual_stages),
        prefer_intra_node=config.cluster.device_place_prefer_intra_node,
        peak_tflops=pick(args.peak_tflops, config.profiler.peak_tflops),
        tensor_parallel=args.tensor_parallel,
        offload=pick(args.offload, bool(config.offload.level)),
    )
    return options, request


def plan_and_estimate(
    model: estimate.ModelCost,
    options: estimate.TrainOptions,
    request: PlanRequest,
    num_workers: int,
    gpu_per_worker: int,
    *,
    device_type: str = "GPU",
) -> estimate.Estimate:
    """Cuts `model` into `request.num_stages`, plans it on a virtual cluster and estimates
    it. With `request.tensor_parallel` t > 1 every planned device stands for a tensor group
    of t devices of one worker, each holding a rank's share (`step_time.tensor_parallel_model`).
    """
    num_stages, t = request.num_stages, request.tensor_parallel
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1. Received: num_stages={num_stages!r}")
    if isinstance(t, bool) or not isinstance(t, int) or t < 1 or gpu_per_worker % t:
        raise ValueError(
            "tensor_parallel must be an int >= 1 dividing gpu_per_worker (a tensor group stays "
            f"in one worker). Received: tensor_parallel={t!r}, gpu_per_worker={gpu_per_worker}"
        )
    whole, model = model, step_time.tensor_parallel_model(model, t)
    gpu_per_worker //= t
    cuts = estimate.partition_stages(model, num_stages)
    bounds = (0, *cuts, len(model.nodes))
    stage_flops = [sum(n.flops for n in model.nodes[a:b]) for a, b in itertools.pairwise(bounds)]
    where = ", ".join(f"stage {k + 1} at {model.nodes[c].name}" for k, c in enumerate(cuts))
    plan = planner.build_plan(
        [StrategySpec("replicate", 1, f"stage_{k}") for k in range(num_stages)],
        estimate.virtual_cluster(num_workers, gpu_per_worker, device_type),
        0,
        num_micro_batch=request.num_micro_batch,
        prefer_intra_node=request.prefer_intra_node,
        pipeline_strategy=request.pipeline_strategy,
        stage_costs=stage_flops if num_stages > 1 else None,
        cut_description=f"forward FLOPs balanced; {where}" if cuts else None,
        virtual_stages=request.virtual_stages,
    )
    result = estimate.estimate(model, plan, options, cuts=cuts)
    # The report's model is the whole one (its parameters, FLOPs, the host copy); the
    # stages hold one tensor rank's share.
    return dataclasses.replace(result, model=whole)


def device_peaks(result: estimate.Estimate) -> tuple[list[float], list[float]]:
    """(peak bytes, micro-batches' worth of activations alive at most) of each device of
    a pipeline replica: its stages' model states, workspace and buffers, and the
    activations alive at once over its stages in the schedule's order. With one stage
    per device, each stage's `peak` and `inflight`; under interleaved 1F1B a device sums
    its v stages (chunks), whose activations peak together only in part."""
    plan, stages = result.plan, result.stages
    schedule = make_schedule(
        plan.pipeline_strategy, len(stages), plan.num_micro_batch, plan.virtual_stages
    )
    activations = device_peak_in_flight(schedule, [s.activations[s.selected] for s in stages])
    worth = device_peak_in_flight(schedule, [1 / plan.virtual_stages] * len(stages))
    peaks = []
    for device, alive in enumerate(activations):
        hosted = [s for s in stages if s.index % plan.pipeline_devices == device]
        states = sum(s.peak - s.activation_peak - s.workspace for s in hosted)
        workspace = max(s.workspace for s in hosted) + max(s.recompute for s in hosted)
        peaks.append(states + alive + workspace)
    return peaks, worth


def zero_comparison(result: estimate.Estimate) -> list[tuple[str, float]]:
    """Model-state bytes per device of the largest stage at every ZeRO level."""
    stage = max(result.stages, key=lambda s: s.params)
    names = {
        "": "none (replicated)",
        "v0": "v0 (P_os)",
        "v1": "v1 (P_os+g)",
        "v2": "v2 (P_os+g+p)",
    }
    rows = []
    for level in estimate.ZERO_LEVELS:
        states = estimate.model_state_bytes(
            stage.params, stage.devices, level, result.options.amp, result.options.optimizer
        )
        rows.append((names[level], sum(states)))
    return rows


def step_flops(result: estimate.Estimate) -> tuple[float, float]:
    """(model FLOPs of one training step, FLOPs the devices run): 3 x the forward FLOPs per
    sample (the backward costs 2 forwards: gradients of the inputs and of the weights) x
    the global batch; with gradient checkpointing the devices run the forward once more.
    The model FLOPs are what the trainer's `mfu` divides (training/monitors.py)."""
    forward = result.model.flops * result.global_batch
    return 3 * forward, (4 if result.options.gc else 3) * forward


def _flops_section(result: estimate.Estimate, peak_tflops: float) -> list[str]:
    if not result.model.flops:
        return []
    model, hardware = step_flops(result)
    lines = [
        f"FLOPs per step: 3 x {format_count(result.model.flops)} forward per sample x global "
        f"batch {result.global_batch} = {format_count(model)} (model FLOPs: MFU's numerator)"
        + (f"; {format_count(hardware)} with gc's recomputed forward" if hardware > model else "")
    ]
    if peak_tflops:
        placed = result.plan.placement
        workers = len({d.worker for row in placed for devices in row for d in devices})
        seconds = hardware / (peak_tflops * 1e12 * workers)
        lines.append(
            f"  fastest step at the peak ({peak_tflops:g} TFLOP/s x {workers} worker(s)): "
            f"{seconds * 1e3:.4g} ms"
            + (" (MFU 75%: a recomputed forward is not model FLOPs)" if hardware > model else "")
        )
    return [*lines, ""]


def render(
    result: estimate.Estimate,
    device_memory: int | None = None,
    peak_tflops: float = 0.0,
    schedules: list[dict] = (),
) -> str:
    """The human-readable report: model, Plan, FLOPs, memory, activations, bubble, traffic."""
    model, options = result.model, result.options
    flops = f"{format_count(model.flops)} forward FLOPs per sample" if model.flops else ""
    lines = [
        f"Model: {model.name}: {model.description}",
        f"  {model.params:,} parameters" + (f", {flops}" if flops else ""),
        "",
        result.plan.summary(),
        "",
        f"Training: micro-batch {options.micro_batch_size} x {result.plan.num_micro_batch} "
        f"micro-batch(es) x data-parallel {result.data_parallel} = global batch "
        f"{result.global_batch}; zero={options.zero or 'none'}, amp={options.amp or 'none'}, "
        f"gc={'on' if options.gc else 'off'}, optimizer={options.optimizer}",
        "",
    ]
    lines += _flops_section(result, peak_tflops)
    lines += _memory_section(result, device_memory)
    lines += _activation_section(result)
    num_stages, m = len(result.stages), result.plan.num_micro_batch
    strategy, v = result.plan.pipeline_strategy, result.plan.virtual_stages
    work = ("3M", f"3x{m}") if strategy == "ZeroBubbleH1" else ("M", m)
    bubble = f"(S-1)/({work[0]}+S-1) = ({num_stages}-1)/({work[1]}+{num_stages}-1)"
    if strategy == INTERLEAVED:
        p = result.plan.pipeline_devices
        bubble = f"(p-1)/(vM+p-1) = ({p}-1)/({v}x{m}+{p}-1), p = S/v = {num_stages}/{v} devices"
    lines += ["", f"Pipeline bubble: {bubble} = {result.bubble:.3f}", ""]
    lines += _schedule_section(schedules)
    lines += _traffic_section(result)
    return "\n".join(lines)


SCHEDULE_STAGES = (4, 8, 16)  # the devices per pipeline epl-plan compares the schedules at


def schedule_comparison(model, options, request: PlanRequest) -> list[dict]:
    """Each pipeline schedule on 4, 8 and 16 devices (one stage each; Interleaved1F1B cuts
    v times as many stages, v the request's `virtual_stages` or 2), with the request's
    micro-batches and options: its bubble (equal F, B, W costs), the micro-batches' worth
    of activations device 0 and the last device keep alive, and the largest peak per
    device."""
    rows = []
    for count, strategy in itertools.product(SCHEDULE_STAGES, PIPELINE_STRATEGIES):
        v = (request.virtual_stages if request.virtual_stages > 1 else 2) if (
            strategy == INTERLEAVED) else 1  # fmt: skip
        wanted = dataclasses.replace(
            request, num_stages=count * v, pipeline_strategy=strategy, virtual_stages=v
        )
        row = {"stages": count, "strategy": strategy, "virtual_stages": v}
        try:
            result = plan_and_estimate(model, options, wanted, 1, count * request.tensor_parallel)
        except (ValueError, PlanError) as error:  # e.g. fewer layers than stages
            rows.append({**row, "error": str(error)})
            continue
        peaks, worth = device_peaks(result)
        largest = max(range(count), key=peaks.__getitem__)
        rows.append({
            **row,
            "bubble": result.bubble,
            "in_flight": [_count(worth[0]), _count(worth[-1])],
            "largest_peak": peaks[largest],
            "largest_peak_stage": largest,
        })  # fmt: skip
    return rows


def _count(value: float):
    return int(value) if value == int(value) else round(value, 2)


def _schedule_section(schedules: list[dict]) -> list[str]:
    if not schedules:
        return []
    rows = []
    for row in schedules:
        name = row["strategy"] + (f" v={row['virtual_stages']}" if row["virtual_stages"] > 1
                                  else "")  # fmt: skip
        if "error" in row:
            rows.append([str(row["stages"]), name, "-", "-", row["error"][:60]])
            continue
        first, last = row["in_flight"]
        peak = f"{fmt(row['largest_peak'])} (device {row['largest_peak_stage']})"
        rows.append([str(row["stages"]), name, f"{row['bubble']:.3f}", f"{first} / {last}",
                     peak])  # fmt: skip
    lines = [
        "Schedules on 4, 8 and 16 devices (one stage each, v with Interleaved1F1B; these "
        "micro-batches and options; bubble with equal F, B, W costs; ZB-H1 keeps its "
        "micro-batches until W; in flight: micro-batches' worth of activations):"
    ]
    lines += _table(["devices", "strategy", "bubble", "in flight d0 / last", "largest peak"],
                    rows)  # fmt: skip
    return [*lines, ""]


def _memory_section(result: estimate.Estimate, device_memory: int | None) -> list[str]:
    header = ["stage", "devices", "params", "parameters", "gradients", "optimizer"]
    header += ["model states", "activations", "peak"]
    rows = []
    for s in result.stages:
        acts = f"{fmt(s.activations[s.selected])} x {s.inflight}" + (
            f" + {fmt(s.recompute)}" if s.recompute else ""
        )
        acts = acts if result.model.has_activations else "unknown"
        sizes = (s.parameters, s.gradients, s.optimizer, s.model_states)
        cells = [str(s.index), str(s.devices), format_count(s.params), *map(fmt, sizes)]
        rows.append([*cells, acts, fmt(s.peak)])
    if device_memory:
        header.append(f"of {fmt(device_memory)}")
        for row, s in zip(rows, result.stages):
            too_big = " (too big)" if s.peak > device_memory else ""
            row.append(f"{s.peak / device_memory:.0%}{too_big}")
    lines = ["Per device (every device of a stage holds the same):", *_table(header, rows)]
    worst = max(result.stages, key=lambda s: s.peak)
    largest, where = worst.peak, f"stage {worst.index}"
    plan = result.plan
    if plan.virtual_stages > 1:  # a device holds v of the stages above
        peaks, _ = device_peaks(result)
        device = max(range(len(peaks)), key=peaks.__getitem__)
        largest, where = peaks[device], f"device {device}"
        lines.append(
            f"  each device runs {plan.virtual_stages} of these stages (stage k on device k mod "
            f"{plan.pipeline_devices}); peak per device, its stages' activations alive at "
            "once in the schedule's order: "
            + ", ".join(f"device {d} {fmt(peak)}" for d, peak in enumerate(peaks))
        )
    if device_memory:
        verdict = "fits" if largest <= device_memory else "does NOT fit"
        lines.append(
            f"  largest peak {fmt(largest)} ({where}) {verdict} in {fmt(device_memory)} per device"
        )
    lines.append(
        f"  host memory per worker {fmt(result.host_bytes)}: the Keras model and its"
        " optimizer's state, whole (what model.save reads; ZeRO shards the devices' copies)"
    )
    lines += [
        "  activations = bytes per micro-batch x micro-batches kept alive"
        " (+ one recomputed segment with gc);",
        "  peak = parameters + optimizer + the full stage gradients (accumulated before the"
        " reduction) + activations + collective buffers + backward workspace",
    ]
    return lines


def _activation_section(result: estimate.Estimate) -> list[str]:
    variants = ("fp32", "gc", "amp", "amp+gc")
    rows = [
        [str(s.index)]
        + [fmt(s.activations[v]) + (" *" if v == s.selected else "") for v in variants]
        for s in result.stages
    ]
    lines = ["", "Activations per micro-batch and device (* = these options):"]
    lines += _table(["stage", "fp32", "gc", "amp (16-bit)", "amp + gc"], rows)
    if not result.model.has_activations:
        lines.append("  (the model is known only by its parameter count: activations unknown)")
    return lines


def _traffic_section(result: estimate.Estimate) -> list[str]:
    collective = {
        "": "all-reduce",
        "v0": "all-reduce + all-gather",
        "v1": "reduce-scatter + all-gather",
        # estimate._stage: each micro-batch's gradients reduce-scattered, the weights
        # gathered once per step (with checkpointing, twice per micro-batch).
        "v2": "reduce-scatter per micro-batch + all-gathers of the weights",
    }[result.options.zero]
    rows = [
        [str(s.index), fmt(s.comm_data_parallel), fmt(s.comm_pipeline), fmt(s.comm)]
        for s in result.stages
    ]
    lines = ["Communication per step, bytes each device sends (ring collectives):"]
    lines += _table(["stage", f"data-parallel ({collective})", "pipeline (p2p)", "total"], rows)
    largest = max(result.stages, key=lambda s: s.params)
    lines += [
        "",
        "ZeRO levels, model states per device (stage with most parameters, "
        f"N = {largest.devices}):",
    ]
    lines += _table(
        ["zero.level", "model states"], [[n, fmt(b)] for n, b in zero_comparison(result)]
    )
    return lines


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out.append("  " + "  ".join("-" * w for w in widths))
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return out


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'32GB' (1e9 bytes per GB, as the ZeRO paper and GPU vendors count), '80GiB',
    '1.5e10' -> bytes."""
    value = str(text).strip().lower().replace(" ", "")
    number = value.rstrip("kmgtib")
    unit = value[len(number) :]
    try:
        count = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"Cannot read a byte count from {text!r}; write e.g. 32GB, 80GiB or 3.2e10."
        ) from None
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"A byte count must be positive and finite. Received: {text!r}")
    return int(count)


def fmt(count: float) -> str:
    """Bytes with decimal units (GB = 1e9, the ZeRO paper's unit): '31.4 GB'."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(count) >= scale:
            return (
                f"{count / scale:.3g} {unit}"
                if count / scale < 100
                else f"{count / scale:.0f} {unit}"
            )
    return f"{count:.0f} B"


def device_from_args(args) -> devices.DeviceSpec | None:
    """The device of `--device`, with `--peak_tflops` (one worker's peak, shared by its
    `--gpu_per_worker` devices) and `--device_memory` replacing its values; a custom
    device when only those are given; None when nothing describes one."""
    peak = args.peak_tflops / args.gpu_per_worker if args.peak_tflops else None
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    if args.device is None and peak is None:
        return None
    base = devices.device_by_name(args.device) if args.device else None
    spec = devices.custom_device(base, peak_tflops=peak, memory_bytes=memory)
    if not spec.shares_compute:  # a worker is a node: its devices share the fast links
        spec = dataclasses.replace(spec, devices_per_node=args.gpu_per_worker)
    return spec


def layout_of(result: estimate.Estimate, request: PlanRequest) -> step_time.Layout:
    """The step-time model's description of the planned job."""
    plan, options = result.plan, result.options
    return step_time.Layout(
        data_parallel=result.data_parallel,
        tensor_parallel=request.tensor_parallel,
        pipeline_parallel=plan.pipeline_devices,
        virtual_stages=plan.virtual_stages,
        num_micro_batch=plan.num_micro_batch,
        micro_batch_size=options.micro_batch_size,
        schedule=plan.pipeline_strategy
        if plan.pipeline_devices > 1 or plan.virtual_stages > 1
        else "PreferBackward",
        zero=options.zero,
        amp=options.amp,
        gc=options.gc,
        offload=request.offload,
        optimizer=options.optimizer,
    )


def _prediction_section(prediction: step_time.Prediction, device: devices.DeviceSpec) -> list:
    layout = prediction.layout
    terms = ", ".join(f"{name} {value * 1e3:.4g}" for name, value in prediction.terms.items()
                      if value > 0)  # fmt: skip
    fits = "fits" if prediction.fits else "does NOT fit"
    return [
        "",
        f"Step time on {layout.devices} x {device.name} (peak "
        f"{prediction.peak_flops / 1e12:.4g} TFLOP/s, {fmt(device.memory_bytes)} per device; "
        "constants and their sources: docs/guides/plan-a-job.md):",
        f"  step {prediction.step_time_s * 1e3:.4g} ms = {terms} (ms)",
        f"  {prediction.samples_per_second:.4g} samples/s, {prediction.tflops_per_device:.4g} "
        f"TFLOP/s per device of model FLOPs, MFU {prediction.mfu:.1%}",
        f"  peak memory {fmt(prediction.peak_memory_bytes)} "
        f"{'per process (shared by its devices)' if device.shares_compute else 'per device'}: "
        f"{fits}",
        *_calibration_warning(device),
        "",
    ]


def _calibration_warning(device: devices.DeviceSpec) -> list[str]:
    """The "cpu" device's rates are one machine's: a line saying so where this is
    another kind of CPU (its step times could be 2x off)."""
    stale = devices.stale_cpu_calibration() if device.name == "cpu" else ""
    return [f"  warning: {stale}"] if stale else []


def _search_section(found: search.SearchResult) -> list[str]:
    if not found.layouts:
        return ["Search: no layout fits the device memory.", ""]
    rows = [
        [str(rank + 1), p.layout.describe(), f"{p.step_time_s * 1e3:.4g}",
         f"{p.tflops_per_device:.4g}", f"{p.mfu:.1%}", fmt(p.peak_memory_bytes)]
        for rank, p in enumerate(found.layouts)
    ]  # fmt: skip
    lines = [
        f"Fastest layouts that fit ({found.evaluated} predictions over {found.candidates} "
        "layouts; gc and offload tried only where a layout does not fit without):"
    ]
    lines += _table(["#", "layout", "step ms", "TFLOP/s/device", "MFU", "peak/device"], rows)
    best = found.layouts[0].layout
    lines.append("Config of the best (save with --save_config, run with --epl_config):")
    lines.append("  " + json.dumps(best.config()))
    if best.tensor_parallel > 1:
        lines.append(
            f"  tensor parallel {best.tensor_parallel}: a keras.distribution DeviceMesh with "
            f"axes (batch, model) = ({best.data_parallel}, {best.tensor_parallel}) and a "
            "LayoutMap splitting the transformer layers (docs/guides/plan-a-job.md)"
        )
    return [*lines, ""]


_LAYOUT_FLAGS = {"layout_map", "mesh", "kv_heads", "head_dim", "tie_embeddings"}
# What --layout_map reads; every other flag given with it would be ignored: refused.
_LAYOUT_MODE_FLAGS = _LAYOUT_FLAGS | {"layers", "hidden", "heads", "ffn", "vocab"} | {
    "optimizer", "device_memory", "json"}  # fmt: skip


def layout_placement(args, parser) -> kerashub_layouts.Placement:
    """The placement `--layout_map` asks for, its flags checked."""
    ignored = sorted(
        dest for dest, value in vars(args).items()
        if dest not in _LAYOUT_MODE_FLAGS and value != parser.get_default(dest)
    )  # fmt: skip
    if ignored:
        parser.error(f"--layout_map does not take {' '.join('--' + f for f in ignored)}")
    needed = ("layers", "hidden", "heads", "ffn", "vocab", "mesh")
    missing = [f"--{name}" for name in needed if getattr(args, name) is None]
    if args.layout_map == "gemma" and args.head_dim is None:
        missing.append("--head_dim")
    if missing:
        parser.error(f"--layout_map {args.layout_map} needs {' '.join(missing)}")
    sizes = kerashub_layouts.DecoderSizes(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        intermediate=args.ffn,
        vocab=args.vocab,
        head_dim=args.head_dim,
        tie_embeddings=args.tie_embeddings,
    )
    return kerashub_maps.kerashub_placement(args.layout_map, sizes, args.mesh)


def _grouped_variables(placement: kerashub_layouts.Placement) -> list[tuple]:
    """(path with the layer index as *, shape, layout, bytes per device, count) in order:
    a layer's variables once for all layers."""
    groups = {}
    for v in placement.variables:
        key = (re.sub(r"^([^/]*?)_\d+/", r"\1_*/", v.path), v.shape, v.axes, v.bytes_per_device)
        groups[key] = groups.get(key, 0) + 1
    return [(*key, count) for key, count in groups.items()]


def render_layout_placement(
    placement: kerashub_layouts.Placement, optimizer: str, device_memory: int | None
) -> str:
    family = kerashub_layouts.FAMILIES[placement.family]
    batch, model = placement.mesh
    rows = []
    for path, shape, axes, per_device, count in _grouped_variables(placement):
        layout = "replicated" if axes is None else "(" + ", ".join(map(str, axes)) + ")"
        held = fmt(per_device) + (f" x {count}" if count > 1 else "")
        rows.append([path, str(shape), layout, held])
    lines = [
        f"KerasHub {family.backbone}.get_layout_map on a DeviceMesh (batch, model) = "
        f"({batch}, {model}), {placement.devices} devices; float32 variables:",
        *_table(["variable", "shape", "layout", "per device (each)"], rows),
        "",
    ]
    slots = estimate.OPTIMIZER_SLOTS[optimizer]
    states = placement.states_per_device(slots)
    header = ["devices", "variables", "gradients", f"optimizer ({optimizer}, {slots} slots)"]
    cells = [f"0-{placement.devices - 1}" if placement.devices > 1 else "0"]
    cells += [fmt(states[key]) for key in ("variables", "gradients", "optimizer")]
    header.append("total")
    cells.append(fmt(states["total"]))
    if device_memory:
        header.append(f"of {fmt(device_memory)}")
        too_big = " (too big)" if states["total"] > device_memory else ""
        cells.append(f"{states['total'] / device_memory:.0%}{too_big}")
    share = placement.bytes_per_device / placement.model_bytes
    lines += [
        "Per device (every device holds the same; gradients and optimizer slots are laid "
        "out as their variable):",
        *_table(header, [cells]),
        f"  the whole model: {format_count(placement.parameters)} parameters, "
        f"{fmt(placement.model_bytes)}; a device holds {share:.3f} of it, "
        f"{placement.bytes_per_device:,} bytes of variables (what EPLTrainer.placement() "
        "reports)",
    ]
    return "\n".join(lines)


def layout_main(args, parser) -> int:
    """`epl-plan --layout_map ...`: what each device of the mesh holds."""
    try:
        placement = layout_placement(args, parser)
        device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    except ValueError as error:
        parser.error(str(error))
    slots = estimate.OPTIMIZER_SLOTS[args.optimizer]
    if args.json:
        data = {"layout_map": placement.to_dict(slots), "device_memory": device_memory}
        text = json.dumps(data, indent=1)
    else:
        text = render_layout_placement(placement, args.optimizer, device_memory)
    return _print(text)


def _print(text: str) -> int:
    try:
        print(text)
    except BrokenPipeError:  # `epl-plan ... | head`: the reader left; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.layout_map:
        return layout_main(args, parser)
    given = sorted(flag for flag in _LAYOUT_FLAGS if getattr(args, flag) is not None)
    if given:
        parser.error(f"{' '.join('--' + f for f in given)} describe a --layout_map")
    try:
        model = model_from_args(args, parser)
        options, request = options_from_args(args)
        device_memory = parse_bytes(args.device_memory) if args.device_memory else None
        result = plan_and_estimate(
            model,
            options,
            request,
            args.num_workers,
            args.gpu_per_worker,
            device_type=args.device_type,
        )
        schedules = schedule_comparison(model, options, request)
        device = device_from_args(args)
        if args.search and device is None:
            raise ValueError("--search needs a device: give --device or --peak_tflops.")
        prediction = found = None
        if device is not None:
            prediction = step_time.predict(model, layout_of(result, request), device)
        if args.search:
            total = args.num_workers * args.gpu_per_worker
            found = search.search(
                model, device, total, args.global_batch or result.global_batch,
                top=args.top, amp=options.amp, optimizer=options.optimizer,
            )  # fmt: skip
            if args.save_config and found.best is not None:
                with open(args.save_config, "w") as f:
                    json.dump(found.best.layout.config(), f, indent=1)
    except (ValueError, PlanError, ConfigError) as error:
        parser.error(str(error))
    if args.json:
        data = result.to_dict()
        data["zero_levels"] = dict(zero_comparison(result))
        data["device_memory"] = device_memory
        data["model_flops_per_step"], data["device_flops_per_step"] = step_flops(result)
        data["schedules"] = schedules
        if prediction is not None:
            data.update({key: value for key, value in prediction.to_dict().items()
                         if key not in ("layout", "config")})  # fmt: skip
        if found is not None:
            data["layouts"] = [p.to_dict() for p in found.layouts]
        text = json.dumps(data, indent=1)
    else:
        text = render(result, device_memory, request.peak_tflops, schedules)
        if prediction is not None:
            text += "\n" + "\n".join(_prediction_section(prediction, device))
        if found is not None:
            text += "\n" + "\n".join(_search_section(found))
    return _print(text)


if __name__ == "__main__":
    sys.exit(main())
