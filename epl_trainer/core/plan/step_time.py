"""Step time, throughput and MFU of a layout on a described cluster, by arithmetic.

The time of one training step is built from terms, each from a constant of the device
table (`devices.py`) and a count of the model (`estimate.ModelCost`), in this order:

1. Compute per micro-batch and device: where a node's matmuls are known by shape
   (`NodeCost.gemms`, the analytic models), each forward matmul and its two backward
   products (input and weight gradients) by `matmul_s`: FLOPs / (the matmul rate x the
   wave efficiency over the device's SMs), or operands and result / the streaming
   bandwidth, whichever is longer (each sample's own small products, attention's per
   head, at `DeviceSpec.batched_matmul_efficiency` of the rate); otherwise the node's
   forward FLOPs x the micro-batch / the matmul rate (peak x matmul efficiency, 16-bit
   with AMP), backward twice that. The elementwise bytes / the streaming bandwidth (the
   memory bandwidth x the share a streaming kernel reaches; on a shared pool x
   `DeviceSpec.elementwise_factor`, a layer's ops reading from the caches), backward as
   counted (`NodeCost.elementwise_backward_bytes`, a traced step's ops) or twice the
   forward; with gradient checkpointing the forward once more, but for the nodes whose
   outputs no backward reads (`estimate.recomputed_nodes`: TensorFlow prunes them; a
   transformer block's last projection and residual add). Tensor parallelism
   (`tensor_parallel_model`) divides the nodes it splits (transformer layers,
   vocabulary-parallel embeddings and heads) and their matmuls as Megatron does
   (columns, inner size or heads). From a stage's second micro-batch on, each backward
   adds its weight gradients to the running sum: one streaming pass over them
   (`accumulation_bytes`).
2. Tensor-parallel all-reduces: Megatron's layer sums its activations twice in forward
   and twice in backward (again in a recomputed forward), over the tensor group's link;
   with ZeRO-R's partitioned checkpoints an all-gather of each layer's checkpoint too.
3. Pipeline sends: each micro-batch's boundary activations forward and their gradients
   back (each tensor rank sends its 1/t share, and the receiving group all-gathers it:
   Megatron's scatter / gather).
4. Per-layer overhead (kernel launches, the runtime's per-op cost) per micro-batch.
5. The schedule: `m` micro-batches on the slowest device plus the bubble of
   `schedule.bubble_fraction` (GPipe and 1F1B (p-1)/(m+p-1), interleaved
   (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1)). Devices that share one compute pool (logical
   CPU devices) cannot hide a bubble behind idle cores: their step is at least the sum
   of all devices' work on the pool, at the rates measured for that many devices side
   by side (`DeviceSpec.pool_rates`); a device on its own runs at one thread's
   (`devices.device_rates`: cores // devices threads per op), but for a backward's input
   and weight gradients, which its inter-op threads run side by side
   (`devices.device_pair_rate`; not where the schedule splits them, ZB-H1's B and W).
6. Data-parallel communication (`StageEstimate.comm_data_parallel`: all-reduce, ZeRO's
   reduce-scatter and all-gathers) over the data group's link; overlapped with the last
   micro-batch's backward where the engine overlaps it and the device has separate
   communication engines.
7. The optimizer update, bound by the streaming bandwidth (Adam reads the parameter,
   gradient and both slots and writes three: 28 bytes per float32 parameter; amp
   "master" adds its float32 gradient copy, unscaling and 16-bit weight copy: 48), on the
   device's share of the parameters (ZeRO divides it); an update below 1M parameters
   runs as plain ops, `PLAIN_UPDATE_SLOWDOWN` times longer; with offload on host memory,
   plus the weights' trip to the device for every micro-batch and the gradients' back
   over the host link (logical CPU devices share one host copy, updated once).

Peak memory: `device_phase_bytes` walks the schedule (activations and the gradients
alive at once, then the reduction); on a shared pool the prediction is the process's
(`process_peak_bytes`).
8. The step's own overhead.

A collective over N members sends 2(N-1)/N of its buffer (all-reduce; the estimate
counts ZeRO's halves) at the link's bandwidth and takes 2(N-1) latency steps. Its link:
within a node the device's intra-node bandwidth at the share NCCL reaches; across nodes
the node's network bandwidth shared by the groups that cross it at once (a group with g
members per node of n devices gets g / n of it). Which groups are within a node
follows `rank_order`: the engine lays out tensor ranks innermost, then a replica's
pipeline stages, then the replicas ("tp,pp,dp"); Megatron-LM puts data-parallel ranks
inside pipeline stages ("tp,dp,pp").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from epl_trainer.core.plan import estimate as estimate_module
from epl_trainer.core.plan import planner
from epl_trainer.core.plan.analytic import Gemm
from epl_trainer.core.plan.devices import DeviceSpec, device_pair_rate, device_rates
from epl_trainer.core.plan.estimate import OPTIMIZER_SLOTS, ModelCost, NodeCost, TrainOptions
from epl_trainer.core.plan.ir import INTERLEAVED, PIPELINE_STRATEGIES, StrategySpec
from epl_trainer.core.plan.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    bubble_fraction,
    device_orders,
    make_schedule,
    splits_backward,
)

__all__ = [
    "TENSOR_SPLIT_KINDS",
    "Layout",
    "Prediction",
    "device_peak_bytes",
    "device_phase_bytes",
    "estimate_layout",
    "predict",
    "process_peak_bytes",
    "tensor_parallel_model",
]

# Nodes tensor parallelism splits (Megatron's column / row pairs; vocabulary-parallel
# embedding and head), with their (forward, backward) all-reduces of the residual stream.
TENSOR_SPLIT_KINDS = {"TransformerLayer": (2, 2), "Embedding": (1, 0), "Head": (0, 1)}
RANK_ORDERS = ("tp,pp,dp", "tp,dp,pp")
_GRADIENT_BUCKETS = 5  # communication.max_splits: fused all-reduces per stage and step


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a job is laid out: parallel degrees, micro-batches, schedule, memory options.

    `pipeline_parallel` counts devices per pipeline; with Interleaved1F1B each runs
    `virtual_stages` stages, so the model is cut into `pipeline_parallel x
    virtual_stages` stages. The job uses `data_parallel x tensor_parallel x
    pipeline_parallel` devices and its global batch is `data_parallel x num_micro_batch
    x micro_batch_size` (tensor ranks share their micro-batch).

    `partition_activations` is ZeRO-R's P_a (Rajbhandari et al. 2020, section 6.1; the
    ZeRO-100B runs): each tensor rank keeps 1/t of every checkpointed layer input, and
    the tensor group all-gathers it before the layer's recomputed forward. It counts
    that all-gather's time; the memory estimate keeps the checkpoints whole (an
    overestimate). The trainer has no such option (`config()` has no key for it).
    """

    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_stages: int = 1
    num_micro_batch: int = 1
    micro_batch_size: int = 1
    schedule: str = "PreferBackward"
    zero: str = ""
    amp: str = ""
    gc: bool = False
    offload: bool = False
    optimizer: str = "adam"
    overlap_grad_reduce: bool = True
    rank_order: str = "tp,pp,dp"
    partition_activations: bool = False

    def __post_init__(self):
        for key in ("data_parallel", "tensor_parallel", "pipeline_parallel", "virtual_stages",
                    "num_micro_batch", "micro_batch_size"):  # fmt: skip
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{key} must be an int >= 1. Received: {key}={value!r}")
        if self.schedule not in PIPELINE_STRATEGIES:
            raise ValueError(
                f"schedule must be one of {PIPELINE_STRATEGIES}. Received: "
                f"schedule={self.schedule!r}"
            )
        if (self.schedule == INTERLEAVED) != (self.virtual_stages > 1):
            raise ValueError(
                "Interleaved1F1B runs virtual_stages >= 2 stages per device, and only it does. "
                f"Received: schedule={self.schedule!r}, virtual_stages={self.virtual_stages}"
            )
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(
                f"rank_order must be one of {RANK_ORDERS}. Received: {self.rank_order!r}"
            )
        if self.partition_activations and not (self.gc and self.tensor_parallel > 1):
            raise ValueError(
                "partition_activations splits checkpointed activations over a tensor group: "
                f"it needs gc=True and tensor_parallel > 1. Received: gc={self.gc}, "
                f"tensor_parallel={self.tensor_parallel}"
            )
        TrainOptions(zero=self.zero, amp=self.amp, optimizer=self.optimizer)  # validates

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.virtual_stages

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def global_batch(self) -> int:
        return self.data_parallel * self.num_micro_batch * self.micro_batch_size

    def describe(self) -> str:
        parts = [
            f"dp {self.data_parallel} x tp {self.tensor_parallel} x pp {self.pipeline_parallel}",
            f"mb {self.micro_batch_size} x {self.num_micro_batch}",
        ]
        if self.pipeline_parallel > 1:
            parts.append(self.schedule + (f" v={self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))  # fmt: skip
        parts.append(f"zero {self.zero or 'none'}")
        parts += [name for name, on in (("gc", self.gc), ("offload", self.offload),
                                        (f"amp {self.amp}", self.amp)) if on]  # fmt: skip
        return ", ".join(parts)

    def config(self) -> dict:
        """The trainer's config keys for this layout (what `--epl_config` reads; keys at
        their defaults left out). Tensor parallelism has no key: it is a
        `keras.distribution` mesh's model axis."""
        keys = {"pipeline.num_micro_batch": self.num_micro_batch}
        if self.num_stages > 1:
            keys.update({
                "auto.auto_parallel": True,
                "pipeline.num_stages": self.num_stages,
                "pipeline.strategy": self.schedule,
            })  # fmt: skip
        if self.virtual_stages > 1:
            keys["pipeline.virtual_stages"] = self.virtual_stages
        if self.zero:
            keys["zero.level"] = self.zero
        if self.gc:
            keys["gradient_checkpoint.type"] = "auto"
        if self.offload:
            keys["offload.level"] = "v0"
        if self.amp:  # the trainer's AMP: float32 weights, bfloat16 compute
            keys.update({"amp.level": "O1", "amp.dtype": "bfloat16"})
        return keys


@dataclasses.dataclass(frozen=True)
class Prediction:
    """`predict`'s result: the step time and its terms (seconds), throughput, memory."""

    layout: Layout
    device: str
    step_time_s: float
    terms: dict
    model_flops: float  # per step: 3 x forward FLOPs x global batch (MFU's numerator)
    hardware_flops: float  # per step, with a recomputed forward under gc
    peak_memory_bytes: float  # the largest device's; on a shared pool the process's
    memory_bytes: float  # the device's capacity
    peak_flops: float  # one device's peak in the step's compute dtype

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_bytes

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.step_time_s / self.layout.devices / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_device * 1e12 / self.peak_flops

    @property
    def samples_per_second(self) -> float:
        return self.layout.global_batch / self.step_time_s

    def to_dict(self) -> dict:
        return {
            "layout": dataclasses.asdict(self.layout),
            "description": self.layout.describe(),
            "device": self.device,
            "devices": self.layout.devices,
            "global_batch": self.layout.global_batch,
            "step_time_s": self.step_time_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "samples_per_second": self.samples_per_second,
            "peak_memory_bytes": self.peak_memory_bytes,
            "fits": self.fits,
            "model_flops_per_step": self.model_flops,
            "hardware_flops_per_step": self.hardware_flops,
            "terms_s": dict(self.terms),
            "config": self.layout.config(),
        }


# ------------------------------------------------------------------ tensor parallelism
def tensor_parallel_model(model: ModelCost, tensor_parallel: int) -> ModelCost:
    """One tensor rank's share of `model`: the nodes of `TENSOR_SPLIT_KINDS` split their
    parameters, FLOPs, workspace and the split part of their activations and elementwise
    traffic t ways; other nodes run whole on every rank.

    Raises:
      ValueError: t > 1 on a model with no node tensor parallelism splits.
    """
    t = tensor_parallel
    if t == 1:
        return model
    if not any(node.kind in TENSOR_SPLIT_KINDS for node in model.nodes):
        raise ValueError(
            f"Model {model.name!r} has no node tensor parallelism splits (kinds "
            f"{sorted(TENSOR_SPLIT_KINDS)}). Received: tensor_parallel={t}"
        )
    nodes = tuple(_split_node(node, t) if node.kind in TENSOR_SPLIT_KINDS else node
                  for node in model.nodes)  # fmt: skip
    return dataclasses.replace(model, nodes=nodes, description=f"{model.description}, 1/{t} rank")


def _split_node(node: NodeCost, t: int) -> NodeCost:
    kept = node.tp_replicated_bytes + (node.kept_bytes - node.tp_replicated_bytes) / t
    moved = _elementwise_bytes(node)
    replicated = node.tp_replicated_elementwise_bytes
    forward = replicated + (moved - replicated) / t
    backward = node.elementwise_backward_bytes
    if backward is not None:  # split as the forward is
        backward = round(backward * forward / moved) if moved else backward
    return dataclasses.replace(
        node,
        params=math.ceil(node.params / t),
        param_bytes=math.ceil(node.param_bytes / t),
        flops=node.flops / t,
        activation_bytes=round(kept),
        internal_bytes=0,
        largest_tensor_bytes=math.ceil(node.largest_tensor / t),
        float32_bytes=min(node.float32_bytes, round(kept)),
        elementwise_bytes=round(forward),
        elementwise_backward_bytes=backward,
        gemms=tuple(_split_gemm(gemm, t) for gemm in node.gemms),
    )


def _split_gemm(gemm: Gemm, t: int) -> Gemm:
    """One tensor rank's part of a matmul: Megatron's column-parallel matmuls keep 1/t of
    the columns, row-parallel ones 1/t of the inner size, attention 1/t of the heads."""
    if gemm.split in ("n", "k", "count"):
        return gemm._replace(**{gemm.split: getattr(gemm, gemm.split) / t})
    return gemm


def _elementwise_bytes(node: NodeCost) -> float:
    # Not counted (a Keras graph's layer): the layer reads and writes its output-sized
    # tensors once besides its matmul.
    return node.elementwise_bytes or 2 * node.activation_bytes


def _elementwise_backward_bytes(node: NodeCost) -> float:
    # Not counted: backward moves twice the forward's bytes (each op's gradient reads
    # its upstream gradient and its saved input, and writes its input's gradient).
    if node.elementwise_backward_bytes is None:
        return 2 * _elementwise_bytes(node)
    return node.elementwise_backward_bytes


# ------------------------------------------------------------------ memory
def estimate_layout(model: ModelCost, layout: Layout) -> estimate_module.Estimate:
    """`estimate.estimate` of one tensor rank's model on the layout's data x pipeline
    devices (what every rank of a tensor group holds)."""
    shard = _tensor_shard(model, layout.tensor_parallel)
    cuts = _cuts(shard, layout.num_stages)
    plan = planner.build_plan(
        [StrategySpec("replicate", 1, f"stage_{k}") for k in range(layout.num_stages)],
        estimate_module.virtual_cluster(1, layout.data_parallel * layout.pipeline_parallel),
        0,
        num_micro_batch=layout.num_micro_batch,
        pipeline_strategy=layout.schedule,
        virtual_stages=layout.virtual_stages,
    )
    options = TrainOptions(
        micro_batch_size=layout.micro_batch_size, zero=layout.zero, amp=layout.amp,
        gc=layout.gc, optimizer=layout.optimizer,
    )  # fmt: skip
    return estimate_module.estimate(shard, plan, options, cuts=cuts)


# A search estimates many layouts of one model: its shards and cuts are computed once.
_tensor_shard = functools.lru_cache(maxsize=64)(tensor_parallel_model)
_cuts = functools.lru_cache(maxsize=1024)(estimate_module.partition_stages)


def device_peak_bytes(result: estimate_module.Estimate, offload: bool = False) -> list[float]:
    """Peak bytes of each device of a pipeline: its stages' parameters and optimizer state
    (in host memory with offload), plus the larger of two phases (`device_phase_bytes`)."""
    return [fixed + max(during, end) for fixed, during, end in device_phase_bytes(result, offload)]


def device_phase_bytes(result: estimate_module.Estimate, offload: bool = False) -> list[tuple]:
    """Per device of a pipeline, (fixed, during, end) bytes:

    * fixed: its stages' parameters and optimizer state (not with offload);
    * during the schedule: the activations alive at once over its stages in the
      schedule's order, with the gradients alive then, plus the largest backward
      workspace and recomputed segment. Gradients: none before a stage's first backward
      with one micro-batch per step; with several, the engine adds each micro-batch's
      gradients to a running sum, which the stage keeps from its first backward on
      (one set, ZeRO v1 / v2 its reduced shard), with the next backward's gradients
      (its crossover) while they are added: the stage's next backward waits for the
      sum, so grappler's arithmetic optimizer does not rewrite the adds into one AddN
      over every micro-batch's gradients (executor.py; `bench/plan_accuracy.py` row
      30's peak no longer grows with the micro-batches); a
      looped stage holds its running sums from the start; under gradient checkpointing
      a micro-batch's own gradients exist by its first segment's recompute;
    * at the end: the gradients, the reduction's buffers and ZeRO v2's gathered
      parameters, once the activations are freed.
    """
    plan, stages = result.plan, result.stages
    options, m = result.options, plan.num_micro_batch
    looped = estimate_module.loops_micro_batches(len(stages), m, options.zero)
    sharded = options.zero in ("v1", "v2")  # micro-batches' gradients reduce-scattered
    activation = [s.activations[s.selected] for s in stages]
    # The running sum a stage keeps from its first backward on: its gradients, or the
    # reduced shard of them ZeRO v1 / v2 sums over the micro-batches.
    kept = [(s.gradients if sharded else s.full_gradients) if m > 1 and not looped else 0
            for s in stages]  # fmt: skip
    states = _schedule_states(plan.pipeline_strategy, len(stages), m, plan.virtual_stages)
    phases = []
    for hosted, counts in states:
        hosted_stages = [stages[k] for k in hosted]
        weights = [activation[k] for k in hosted] + [kept[k] for k in hosted]
        summed = np.hstack([counts[:, : len(hosted)], np.minimum(counts[:, len(hosted) :], 1)])
        during = float(np.max(summed @ np.array(weights, dtype=np.float64)))
        if looped:  # the loop's micro-batch and the last one, the loop's running sums
            during = sum(s.inflight * activation[s.index] + s.full_gradients
                         for s in hosted_stages)  # fmt: skip
        if options.gc:
            during += sum(s.full_gradients for s in hosted_stages)
        else:  # one backward at a time on a device
            during += max(backward_crossover_bytes(result, s) for s in hosted_stages)
        during += max(s.workspace for s in hosted_stages)
        during += max(s.recompute for s in hosted_stages)
        end = sum(max(s.gradients, s.full_gradients) + s.comm_buffers + s.gathered
                  for s in hosted_stages)  # fmt: skip
        fixed = sum(s.parameters + s.optimizer for s in hosted_stages)
        if offload:
            fixed = 0
        phases.append((fixed, during, end))
    return phases


def process_peak_bytes(result: estimate_module.Estimate, layout: Layout, device: DeviceSpec):
    """The peak of one process whose logical devices share its memory (`shares_compute`:
    the "cpu" device, whose devices share one allocator, so only the process's peak can
    be measured or run out): the host copy of the model and its optimizer
    (`Estimate.host_bytes`; with offload the offloaded states too, once per worker),
    every replica's parameters and optimizer state, and the replicas' activations as
    the runtime runs them: `cores` at a time. TensorFlow's executor runs a ready op's
    successor on the thread that ran the op, so each of its `cores` inter-op threads
    follows one replica, and the rest wait; a replica that has finished keeps its
    gradients and reduction buffers until the last one reduces (a trace of 4 replicas
    on 2 cores: two run forward and backward, then the other two). A pipeline's devices
    count with their own peaks, summed."""
    phases = device_phase_bytes(result, layout.offload)
    fixed = sum(f for f, _, _ in phases)
    busy = sum(max(during, end) for _, during, end in phases)
    done = sum(end for _, _, end in phases)
    replicas = layout.data_parallel * layout.tensor_parallel
    running = min(replicas, device.cores)
    peak = result.host_bytes + replicas * fixed + running * busy + (replicas - running) * done
    if layout.offload:
        peak += sum(stage.parameters + stage.optimizer for stage in result.stages)
    return peak


def backward_crossover_bytes(result: estimate_module.Estimate, stage) -> float:
    """Bytes a micro-batch's backward holds beyond its activations: backward runs the
    stage's layers last to first, freeing each layer's activations and making its weight
    gradients, so before layer i it holds the activations of the layers before i and the
    gradients of i and the ones after; the most over i, less all activations (0 where
    the activations outweigh the gradients, as in a transformer; most of the gradients
    where the weights do, as in an MLP)."""
    model, options = result.model, result.options
    start, stop = stage.nodes
    nodes = model.nodes[start:stop]
    low = 2 / model.activation_dtype_bytes
    per_sample = [estimate_module.amp_bytes(n, low) if options.amp else n.kept_bytes
                  for n in nodes]  # fmt: skip
    activations = [b * options.micro_batch_size for b in per_sample]
    per_param = stage.full_gradients / stage.params if stage.params else 0.0
    gradients = [n.params * per_param for n in nodes]
    before, after = 0.0, sum(gradients)
    most = after
    for kept, made in zip(activations, gradients):
        before, after = before + kept, after - made
        most = max(most, before + after)
    return max(0.0, most - sum(activations))


@functools.lru_cache(maxsize=256)
def _schedule_states(strategy: str, num_stages: int, num_micro_batch: int, virtual_stages: int):
    """Per device: (the stages it hosts, the distinct counts after each task of the
    schedule as an array's rows: for each hosted stage its micro-batches alive, then its
    backwards done), built once per schedule shape (a search weighs them thousands of
    times)."""
    orders = _device_orders(strategy, num_stages, num_micro_batch, virtual_stages)
    result = []
    for pairs in orders:
        hosted = tuple(sorted({stage for stage, _ in pairs}))
        position = {k: i for i, k in enumerate(hosted)}
        alive, done = [0] * len(hosted), [0] * len(hosted)
        counts = {(0,) * (2 * len(hosted))}
        for stage, change in pairs:
            alive[position[stage]] += change
            done[position[stage]] += change < 0
            counts.add((*alive, *done))
        result.append((hosted, np.array(sorted(counts), dtype=np.float64)))
    return tuple(result)


@functools.lru_cache(maxsize=256)
def _splits_backward(strategy: str, num_stages: int, num_micro_batch: int, virtual_stages: int):
    return splits_backward(make_schedule(strategy, num_stages, num_micro_batch, virtual_stages))


@functools.lru_cache(maxsize=256)
def _device_orders(strategy: str, num_stages: int, num_micro_batch: int, virtual_stages: int):
    """Each device's (stage, kind) order of the schedule, built and checked once: +1 when
    a micro-batch's forward keeps its activations, -1 when its last backward task (B, or
    W in a split backward) frees them and leaves its weight gradients."""
    schedule = make_schedule(strategy, num_stages, num_micro_batch, virtual_stages)
    last = WEIGHT if splits_backward(schedule) else BACKWARD
    step = {FORWARD: 1, last: -1}
    return tuple(tuple((stage, step.get(task.kind, 0)) for stage, task in pairs)
                 for pairs in device_orders(schedule))  # fmt: skip


# ------------------------------------------------------------------ matmuls
def wave_efficiency(device: DeviceSpec, rows: float, cols: float, count: float = 1) -> float:
    """The share of the SMs' tile slots a `rows` x `cols` output (`count` times) fills:
    the library cuts it into tiles, one thread block each, and runs them in waves of one
    per SM; partial tiles and a last partial wave leave slots idle (the NVIDIA Matrix
    Multiplication guide's tile and wave quantization). The best of the device's tiles
    (the library's heuristic picks one). 1 on a device without SMs."""
    if not device.sm_count or not device.matmul_tiles:
        return 1.0
    best = 0.0
    for tile_rows, tile_cols in device.matmul_tiles:
        tiles = math.ceil(math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols) * count)
        slots = math.ceil(tiles / device.sm_count) * device.sm_count * tile_rows * tile_cols
        best = max(best, rows * cols * count / slots)
    return best


def matmul_s(device: DeviceSpec, rate: float, element_bytes: float, rows: float, cols: float,
             inner: float, count: float = 1) -> float:  # fmt: skip
    """Seconds of `count` (`rows` x `inner`) @ (`inner` x `cols`) products: their FLOPs at
    `rate` x the wave efficiency, or their operands and result moved once at the streaming
    bandwidth, whichever is longer (a roofline: attention's products with the head size
    as inner dimension are memory-bound on a GPU)."""
    flops = 2 * rows * cols * inner * count
    math_s = flops / (rate * wave_efficiency(device, rows, cols, count))
    moved = element_bytes * count * (rows * inner + inner * cols + rows * cols)
    return max(math_s, moved / device.streaming_bandwidth)


@functools.lru_cache(maxsize=4096)  # a model's layers repeat: each shape timed once
def node_compute_s(node: NodeCost, micro_batch: int, rate: float, device: DeviceSpec,
                   element_bytes: float,
                   pair_rate: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) matmul seconds of `node` for a micro-batch. With its matmuls
    known (`NodeCost.gemms`), each by `matmul_s`, and backward as each matmul's two
    products (input gradient: rows x inner over cols; weight gradient: inner x cols over
    rows), which depend only on the upstream gradient, so a shared pool's device running
    on its own runs them side by side at `pair_rate` (`devices.device_pair_rate`; 0:
    `rate`); the node's other FLOPs are elementwise, timed by their memory traffic. Else
    its FLOPs at `rate`, backward twice forward."""
    if not node.gemms:
        forward = node.flops * micro_batch / rate
        return forward, 2 * forward
    forward = backward = 0.0
    for gemm in node.gemms:
        rows, count, gemm_rate = gemm.rows, gemm.count, rate
        gradient_rate = pair_rate or rate
        if gemm.stacked:
            rows *= micro_batch
        else:  # each sample's own small products (attention's, per head)
            count *= micro_batch
            gemm_rate = gradient_rate = rate * device.batched_matmul_efficiency
        forward += matmul_s(device, gemm_rate, element_bytes, rows, gemm.n, gemm.k, count)
        backward += matmul_s(device, gradient_rate, element_bytes, rows, gemm.k, gemm.n, count)
        backward += matmul_s(device, gradient_rate, element_bytes, gemm.k, gemm.n, rows, count)
    return forward, backward


# ------------------------------------------------------------------ links
def _stride(layout: Layout, axis: str) -> int:
    """Devices between neighbouring members of `axis`'s group in the rank order."""
    sizes = {"tp": layout.tensor_parallel, "pp": layout.pipeline_parallel,
             "dp": layout.data_parallel}  # fmt: skip
    stride = 1
    for name in layout.rank_order.split(","):
        if name == axis:
            return stride
        stride *= sizes[name]
    raise AssertionError(axis)


def _group_bandwidth(device: DeviceSpec, members: int, stride: int) -> float:
    """Bytes/s each member of a group of `members`, `stride` devices apart, sends at."""
    per_node = device.devices_per_node
    if members * stride <= per_node or members == 1:
        return device.nvlink_bandwidth
    in_node = max(1, min(members, per_node // stride))
    return min(device.nvlink_bandwidth, device.inter_node_bandwidth * in_node / per_node)


def _all_gather_s(device: DeviceSpec, buffer: float, members: int, stride: int) -> float:
    """Seconds to gather a `buffer` from `members` shares: (N-1)/N of it over the link,
    N-1 latency steps. Megatron's scatter / gather: a pipeline send crosses nodes as each
    tensor rank's 1/t share, and the receiving tensor group gathers it whole."""
    if members == 1 or buffer == 0:
        return 0.0
    sent = (members - 1) / members * buffer
    return sent / _group_bandwidth(device, members, stride) + (members - 1) * device.latency_s


def _all_reduce_s(device: DeviceSpec, buffer: float, members: int, stride: int) -> float:
    if members == 1 or buffer == 0:
        return 0.0
    sent = 2 * (members - 1) / members * buffer
    latency = 2 * (members - 1) * device.latency_s
    return sent / _group_bandwidth(device, members, stride) + latency


# ------------------------------------------------------------------ time
def predict(model: ModelCost, layout: Layout, device: DeviceSpec) -> Prediction:
    """The step time and memory of `model` trained with `layout` on `device`s."""
    result = estimate_layout(model, layout)
    shard = result.model
    t, p, m, v = (layout.tensor_parallel, layout.pipeline_parallel, layout.num_micro_batch,
                  layout.virtual_stages)  # fmt: skip
    width = 0.5 if layout.amp else 1.0  # 16-bit activations and traffic under AMP
    full_rate = device.flops_rate(layout.amp)
    rate, pool, pair_rate = full_rate, 1, 0.0
    bandwidth = pool_bandwidth = device.streaming_bandwidth
    if device.shares_compute:
        # Each device's ops run on cores // devices threads (runtime/cluster.py): from two
        # devices on, one thread per op. Side by side the devices reach the pool's
        # measured rates; one device on its own, one thread's.
        pool = min(layout.devices, device.cores)
        full_rate, pool_bandwidth = device.pool_rates(layout.devices)
        rate, bandwidth = device_rates(device, layout.devices)
        # A backward's input and weight gradients side by side, unless the schedule runs
        # them as separate tasks (ZB-H1's B and W).
        if not (p > 1 and _splits_backward(layout.schedule, layout.num_stages, m, v)):
            pair_rate = device_pair_rate(device, layout.devices)
    # Sums of whole gradient sets stream from memory (no cache holds them).
    sum_bandwidth, pool_sum_bandwidth = bandwidth, pool_bandwidth
    # A layer's elementwise ops read what the op before wrote: from the caches where they
    # hold a layer's activations (`DeviceSpec.elementwise_factor`).
    bandwidth *= device.elementwise_factor(layout.devices)
    pool_bandwidth *= device.elementwise_factor(layout.devices)
    mb = layout.micro_batch_size

    element_bytes = 4 * width
    stage_terms = []
    for stage in result.stages:
        start, stop = stage.nodes
        nodes = shard.nodes[start:stop]
        forward = backward = pool_compute = 0.0
        again = set(estimate_module.recomputed_nodes(shard, start, stop)) if layout.gc else set()
        recompute = pool_recompute = 0.0  # the forward a checkpointed backward runs again
        for index, node in enumerate(nodes, start):
            node_forward, node_backward = node_compute_s(
                node, mb, rate, device, element_bytes, pair_rate
            )
            forward, backward = forward + node_forward, backward + node_backward
            pool_forward = 0.0  # the pool's rates: only a shared pool's step uses them
            if device.shares_compute:
                pool_forward, pool_backward = node_compute_s(
                    node, mb, full_rate, device, element_bytes
                )
                pool_compute += pool_forward + pool_backward
            if index in again:
                moved_again = _elementwise_bytes(node) * mb * width
                recompute += node_forward + moved_again / bandwidth
                pool_recompute += pool_forward + moved_again / pool_bandwidth
        moved_forward = sum(_elementwise_bytes(node) for node in nodes) * mb * width
        moved = moved_forward + sum(_elementwise_backward_bytes(n) for n in nodes) * mb * width
        syncs = [TENSOR_SPLIT_KINDS.get(node.kind, (0, 0)) for node in nodes]
        stream = [shard.crossing_bytes[i] or shard.crossing_bytes[i + 1]
                  for i in range(start, stop)]  # fmt: skip
        tensor_comm = sum(
            (f * (2 if layout.gc else 1) + b) * _all_reduce_s(device, s * mb * width, t, 1)
            for (f, b), s in zip(syncs, stream)
        )
        if layout.partition_activations:  # gather each layer's checkpoint before recompute
            tensor_comm += sum(
                _all_gather_s(device, s * mb * width, t, 1)
                for node, s in zip(nodes, stream)
                if node.kind == "TransformerLayer"
            )
        sends = 0.0
        if p > 1:
            link = _group_bandwidth(device, p, _stride(layout, "pp"))
            for boundary in (start, stop):
                if 0 < boundary < len(shard.nodes):
                    sent = shard.crossing_bytes[boundary] * mb * width
                    sends += sent / t / link + device.latency_s
                    sends += _all_gather_s(device, sent, t, _stride(layout, "tp"))
        accumulated = accumulation_bytes(stage, layout) / m
        stage_terms.append({
            "compute": forward + backward,
            "elementwise": moved / bandwidth,
            "recompute": recompute,
            "tensor_comm": tensor_comm,
            "pipeline_comm": sends,
            "overhead": device.layer_overhead_s * len(nodes),
            "accumulate": accumulated / sum_bandwidth,
            # The same at the pool's rates, with the recomputed forward.
            "work": pool_compute + moved / pool_bandwidth + pool_recompute
            + accumulated / pool_sum_bandwidth,
        })  # fmt: skip
    # Per micro-batch and device: the sum over the stages it runs.
    per_device = []
    for d in range(p):
        hosted = [terms for k, terms in enumerate(stage_terms) if k % p == d]
        per_device.append({key: sum(terms[key] for terms in hosted) for key in hosted[0]})
    busy = [sum(v for k, v in terms.items() if k != "work") for terms in per_device]
    slowest = max(range(p), key=busy.__getitem__)
    bubble = bubble_fraction(layout.num_stages, m, layout.schedule, v) if p > 1 else 0.0
    pipeline = m * busy[slowest] / (1 - bubble)
    terms = {key: m * value for key, value in per_device[slowest].items() if key != "work"}
    terms["bubble"] = pipeline - m * busy[slowest]
    step_overhead = device.step_overhead_s
    if device.shares_compute:
        # The pool runs every device's work: compute at the pool's full rate, copies on
        # `pool` cores at once, the runtime's per-layer cost as measured for this many
        # devices at once (devices.DeviceSpec.pool_overheads).
        per_layer, step_overhead = device.pool_overheads(layout.devices)
        copies = sum(terms_d["tensor_comm"] + terms_d["pipeline_comm"] for terms_d in per_device)
        replicas = layout.data_parallel * t
        compute_work = sum(terms_d["work"] for terms_d in per_device)
        work = m * (
            replicas * compute_work
            + replicas * copies / pool
            + per_layer / layout.devices * replicas * len(shard.nodes)
        )
        terms["shared_pool"] = max(0.0, work - pipeline)
        pipeline = max(pipeline, work)

    terms["data_comm"] = _data_comm_s(result, layout, device, per_device[slowest])
    terms["optimizer"], terms["offload"] = _update_s(result, layout, device)
    terms["step_overhead"] = step_overhead
    step = pipeline + terms["data_comm"] + terms["optimizer"] + terms["offload"]
    step += step_overhead
    model_flops = 3 * model.flops * layout.global_batch
    peak = max(device_peak_bytes(result, layout.offload))
    if device.shares_compute:  # one allocator for the process's devices
        peak = process_peak_bytes(result, layout, device)
    return Prediction(
        layout=layout,
        device=device.name,
        step_time_s=step,
        terms=terms,
        model_flops=model_flops,
        hardware_flops=model_flops * (4 / 3 if layout.gc else 1),
        peak_memory_bytes=peak,
        memory_bytes=device.memory_bytes,
        peak_flops=device.peak_flops if layout.amp else device.peak_flops_fp32,
    )


def accumulation_bytes(stage, layout: Layout) -> float:
    """Bytes a stage's gradient accumulation reads and writes per step on one device.

    From its second micro-batch on, each backward adds its weight gradients to the
    stage's running sum: the sum and the new gradients read, the sum written, one
    streaming pass over the gradients in their own dtype (ZeRO v2 sums its reduced
    shards). The engine's running sums (core/engine/pipeline/executor.py) and
    Megatron-LM's (its DDP's hook on each parameter adds the micro-batch's `param.grad`
    to `main_grad`) both run this pass as an op of its own; only a weight-gradient GEMM
    that accumulates in place (Megatron's later `--gradient-accumulation-fusion`) saves
    it.
    """
    summed = stage.gradients if layout.zero == "v2" else stage.full_gradients
    return 3 * summed * (layout.num_micro_batch - 1)


def _data_comm_s(result, layout: Layout, device: DeviceSpec, last_backward: dict) -> float:
    """Seconds of data-parallel communication the step waits for: the slowest device's,
    over the stages it runs (an interleaved pipeline's device reduces each of its
    `virtual_stages` stages)."""
    d = layout.data_parallel
    if d == 1:
        return 0.0
    link = _group_bandwidth(device, d, _stride(layout, "dp"))
    per_device = [0.0] * layout.pipeline_parallel
    for stage in result.stages:
        buckets = min(_GRADIENT_BUCKETS, stage.nodes[1] - stage.nodes[0])
        seconds = 0.0
        for kind, sent, calls in _data_collectives(stage, layout):
            seconds += sent / (link * device.collective_speed.get(kind, 1.0))
            steps = 2 * (d - 1) if kind == "all_reduce" else d - 1
            seconds += calls * buckets * steps * device.latency_s
        per_device[stage.index % layout.pipeline_parallel] += seconds
    slowest = max(per_device)
    if layout.overlap_grad_reduce and not device.shares_compute:
        # Buckets reduce while the last micro-batch's backward runs.
        backward = (last_backward["compute"] + last_backward["elementwise"]) * 2 / 3
        slowest = max(0.0, slowest - backward)
    return slowest


def _data_collectives(stage, layout: Layout) -> list[tuple[str, float, int]]:
    """(kind, bytes each device sends per step, calls per bucket) of a stage's data-parallel
    collectives: the estimate's traffic (`estimate._stage`) by kind."""
    d, m = layout.data_parallel, layout.num_micro_batch
    share = (d - 1) / d
    wire = stage.full_gradients  # gradients travel in their own dtype
    if layout.zero == "v2":
        whole = stage.parameters * d  # the shards gathered whole
        gathers = 2 * m if layout.gc else 1
        return [("reduce_scatter", share * wire * m, m),
                ("all_gather", gathers * share * whole, gathers)]  # fmt: skip
    if layout.zero == "v1":
        return [("reduce_scatter", share * wire, 1), ("all_gather", share * stage.parameters, 1)]
    if layout.zero == "v0":
        return [("all_reduce", 2 * share * wire, 1), ("all_gather", share * stage.parameters, 1)]
    return [("all_reduce", 2 * share * wire, 1)]


# Mixed precision with float32 master weights and loss scaling (amp "master": the ZeRO
# paper's, DeepSpeed's and Megatron-LM's fp16 optimizers) adds per parameter and step:
# the 16-bit gradient copied to float32 (read 2, write 4 bytes), unscaled and checked
# for inf / nan in place (read 4, write 4), and the updated master weight copied back to
# the 16-bit weight (read 4, write 2). Gradient clipping's norm is optional, not counted.
_MASTER_COPY_BYTES = 6 + 8 + 6


def update_bytes_per_param(optimizer: str, amp: str) -> int:
    """Bytes the optimizer step reads and writes per parameter: the update reads the
    float32 parameter, gradient and slots and writes the parameter and slots (Adam: 28),
    plus the master-weight copies of amp "master"."""
    slots = OPTIMIZER_SLOTS[optimizer]
    return 4 * (3 + 2 * slots) + (_MASTER_COPY_BYTES if amp == "master" else 0)


# `optimizer.jit_compile="auto"` (core/engine/update/apply.py) compiles an update of at
# least 1M parameters with XLA; a smaller one runs as Keras's plain ops, about ten passes
# over memory per variable instead of one fused loop: Adam on 25M parameters took 59.2 ms
# as plain ops against 20.3 compiled (bench/optim.py, docs/benchmarks.md).
COMPILED_UPDATE_MIN_PARAMS = 1_000_000
PLAIN_UPDATE_SLOWDOWN = 59.2 / 20.3


def _update_s(result, layout: Layout, device: DeviceSpec) -> tuple[float, float]:
    """(optimizer update seconds, offload transfer seconds) of the slowest device."""
    moved_per_param = update_bytes_per_param(layout.optimizer, layout.amp)
    shared_copy = device.shares_compute and layout.offload and not layout.zero
    per_device = [0.0] * layout.pipeline_parallel
    moved_params = [0.0] * layout.pipeline_parallel  # uncompiled updates weigh more
    for stage in result.stages:
        # The device's share of the rows it updates: all of them, or 1/N with ZeRO.
        owned = stage.params / (layout.data_parallel if layout.zero else 1)
        update_size = stage.params if shared_copy else owned
        plain = update_size < COMPILED_UPDATE_MIN_PARAMS
        per_device[stage.index % layout.pipeline_parallel] += owned
        moved_params[stage.index % layout.pipeline_parallel] += owned * (
            PLAIN_UPDATE_SLOWDOWN if plain else 1.0
        )
    params = max(per_device)
    moved = max(moved_params)
    bandwidth = device.host_memory_bandwidth if layout.offload else device.streaming_bandwidth
    if device.shares_compute:
        # Every device's update runs on the shared memory, side by side at the pool's
        # bandwidth. With offload (no ZeRO) the devices of a worker share one host copy
        # of the variables, updated once (update.py, `shared_variables`), by one thread.
        bandwidth = device.pool_rates(layout.devices)[1]
        replicas = layout.data_parallel * layout.tensor_parallel
        params, moved = sum(per_device) * replicas, sum(moved_params) * replicas
        if shared_copy:
            params, moved = sum(per_device), sum(moved_params)
            bandwidth = device_rates(device, layout.devices)[1]
    update = moved * moved_per_param / bandwidth
    offload = 0.0
    if layout.offload:
        # Each micro-batch's weights up to the device when it uses them, the step's
        # gradients down once (memory.md: "compute devices receive each weight when
        # they use it").
        width = 2 if layout.amp else 4
        trips = layout.num_micro_batch + 1
        offload = trips * params * width / device.host_bandwidth
    return update, offload
