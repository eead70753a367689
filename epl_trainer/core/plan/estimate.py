"""Per-device memory, pipeline bubble and communication of a parallel plan, by arithmetic.

Nothing runs and no TensorFlow is imported: a model is a `ModelCost` (per-node
parameters, forward FLOPs and activation bytes per sample, from shapes or from an
analytic description), a cluster is a `Plan` (`core/plan/planner.py` accepts any device
names, so a virtual 64 x 8 GPU cluster is planned like a real one), and the options are
the config keys that change memory (`pipeline.*`, `zero.level`, `amp.level`,
`gradient_checkpoint.type`). `epl-plan` prints the result; the automatic stage
partition (`core/graph/auto_partition.py`) cuts stages with `partition_stages` below, so the
stages `epl-plan` estimates are the stages the trainer builds.

Model states per device (bytes per parameter of the device's stage, as in the ZeRO
paper's section 3.1 with N the data-parallel degree and K the optimizer's bytes):

=================  =======================  ===================  ====================
amp                parameters               gradients            optimizer state (K)
=================  =======================  ===================  ====================
"" / "O1" (ours)   4 (float32; O1 casts on  4 (float32)          4 per slot (Adam: 8)
                   use, no 16-bit copy)
"master"           2 (16-bit copy)          2 (16-bit)           4 master + 4 per slot
(ZeRO paper,                                                     (Adam: K = 12)
DeepSpeed fp16)
=================  =======================  ===================  ====================

`zero.level` "v0" divides the optimizer state by N (the paper's P_os), "v1" also the
gradients (P_os+g); ours adds a float32 copy of each shard's rows that its optimizer
updates (4/N bytes per parameter, what "master" counts in K). With "master" Adam,
7.5e9 parameters and N = 64 that is 120 GB, 31.4 GB and 16.6 GB per device (GB = 1e9
bytes). "master" is not what `amp.level="O1"` does; it is there to compare with the
paper and with DeepSpeed.

Activations per micro-batch: the bytes kept for backward (`NodeCost.kept_bytes` per
sample, times the micro-batch size, halved for 16-bit activations under AMP), plus
the stage's input. With gradient checkpointing only the tensors crossing the segment
boundaries (`ModelCost.checkpoint_positions`) are kept, and one segment at a time is
recomputed in backward. A stage keeps `inflight` micro-batches alive: all M with GPipe
(PreferForward), min(S - s, M) for stage s with 1F1B (PreferBackward), read from the
schedule itself (`core/plan/schedule.py`). The bubble is GPipe's (S - 1) / (M + S - 1), the
same for both schedules; ZB-H1's (S - 1) / (3M + S - 1), whose stages keep min(S, M).
One stage with M > 1 (gradient accumulation) keeps two: the engine runs all but the
last micro-batch as a loop and the last one after it (`LaneExecutor.run_in_loop`), with
no order between the loop and the last one's forward, so the runtime runs them side by
side (`loops_micro_batches`; ZeRO v1 and v2 reduce each micro-batch in turn instead).

Peak per device = parameters + optimizer state + the stage's full gradients (ZeRO v1 no
longer accumulates them, but each micro-batch's gradients exist in full until their
reduce-scatter) + activations + a backward workspace of twice the largest tensor (its
incoming and outgoing gradient) + collective buffers when N > 1: one more copy of the
gradients, the fused all-reduce buffers or v1's packed reduce-scatter buffer. (The shard
v1 sums over micro-batches and a micro-batch's reduced chunk, 2/N more, are not counted:
the members sum each other's blocks one at a time, and measured peaks do not show them,
docs/benchmarks.md#memory-estimates-against-measured-peaks.) v0's all-gather of the
updated parameters runs after the gradients are freed, so it adds no more than its
all-reduce.

Host memory per worker (`Estimate.host_bytes`, counted once in `worker_bytes`): the user's
Keras model and its optimizer's state, whole, the copy Keras reads (4 bytes per parameter
plus 4 per slot); ZeRO shards the devices' copies, not this one.

Communication per step: bytes each device sends with ring collectives (all-reduce
2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N each): plain data
parallelism all-reduces the gradients; ZeRO v0 all-reduces them and all-gathers the
updated parameters; v1 reduce-scatters and all-gathers. Pipeline stages send their
output activations forward and input gradients backward for every micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from epl_trainer.core.plan.ir import Plan
from epl_trainer.core.plan.schedule import bubble_fraction, make_schedule, peak_in_flight

__all__ = [
    "AMP_MODES",
    "OPTIMIZER_SLOTS",
    "ZERO_LEVELS",
    "Estimate",
    "ModelCost",
    "NodeCost",
    "StageEstimate",
    "TrainOptions",
    "balanced_cuts",
    "bubble_fraction",
    "checkpoint_segments",
    "estimate",
    "model_state_bytes",
    "partition_stages",
    "recomputed_nodes",
    "virtual_cluster",
]

ZERO_LEVELS = ("", "v0", "v1", "v2")  # zero.level; the paper's P_os, P_os+g, P_os+g+p
AMP_MODES = ("", "O1", "master")  # amp.level, plus the paper's fp16 + fp32 master weights
# Per-parameter state slots of Keras optimizers (each as large as the parameter).
OPTIMIZER_SLOTS = {
    "sgd": 0,
    "momentum": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "lion": 1,
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
}
_TIE_RTOL = 1e-9


@dataclass(frozen=True)
class NodeCost:
    """The static cost of one compute node (one layer call or one block), per sample.

    Attributes:
      name: layer name, with `[i]` for the i-th call of a shared layer.
      params: weight elements (0 on a shared layer's second and later calls).
      flops: forward FLOPs with batch 1.
      activation_bytes: bytes of the node's outputs with batch 1 (for an analytic block,
        everything the block keeps for backward).
      kind: the layer/op/block class name.
      param_bytes: bytes of those weights.
      largest_tensor_bytes: bytes of the node's largest single tensor with batch 1, for
        nodes that are whole blocks (0: the node is one op; `activation_bytes` is it).
      internal_bytes: bytes the node keeps for backward besides its outputs (attention
        projections and probabilities, a GELU's intermediates, a normalising factor).
      float32_bytes: the part of `kept_bytes` computed in float32 even under AMP
        (Keras's LayerNormalization normalises in at least float32).
      elementwise_bytes: bytes the node's elementwise ops (normalisations, softmax,
        activations, bias adds, residual adds) read and write in its forward, batch 1, in
        float32 (0: not counted; `step_time.py` then takes twice `activation_bytes`).
      elementwise_backward_bytes: the same of its backward (None: twice the forward's);
        counted from a traced step's ops by `core/graph/traffic.py`.
      tp_replicated_bytes: the part of `kept_bytes` every tensor-parallel rank keeps whole
        (Megatron's layer: the normalisations' and the blocks' inputs); the rest splits.
      tp_replicated_elementwise_bytes: the part of `elementwise_bytes` every rank runs
        whole (normalisations, residual adds).
      gemms: the node's forward matmuls by shape (`analytic.Gemm`), where known: the
        step-time model times each (`step_time.py`); () times `flops` at the matmul rate.
      backward_reads_output, backward_reads_inputs: whether the node's backward reads
        its forward output (a ReLU's gradient does; a linear or GELU Dense's, an add's
        do not) and its inputs (a matmul's weight gradient does; an add's does not).
        A recomputed segment's forward runs only the ops whose outputs its backward
        reads (TensorFlow prunes the rest): `recomputed_nodes`.
    """

    name: str
    params: int
    flops: int
    activation_bytes: int
    kind: str = ""
    param_bytes: int = 0
    largest_tensor_bytes: int = 0
    float32_bytes: int = 0
    internal_bytes: int = 0
    elementwise_bytes: int = 0
    elementwise_backward_bytes: int | None = None
    tp_replicated_bytes: int = 0
    tp_replicated_elementwise_bytes: int = 0
    gemms: tuple = ()
    backward_reads_output: bool = True
    backward_reads_inputs: bool = True

    @property
    def kept_bytes(self) -> int:
        """Bytes kept for backward with batch 1."""
        return self.activation_bytes + self.internal_bytes

    @property
    def largest_tensor(self) -> int:
        return self.largest_tensor_bytes or self.activation_bytes


@dataclass(frozen=True)
class ModelCost:
    """What the estimator needs to know about a model.

    Attributes:
      name: shown in reports.
      nodes: per-node costs in topological order.
      cut_positions: node indices in (0, len(nodes)) where a pipeline stage may start.
      crossing_bytes: `crossing_bytes[p]`, activation bytes per sample that a cut before
        node p sends forward (len(nodes) + 1 entries).
      input_bytes: bytes per sample of the model's inputs and labels.
      checkpoint_positions: where gradient checkpointing keeps segment inputs
        (default: `cut_positions`, i.e. block boundaries).
      activation_dtype_bytes: bytes per element the activations were counted in.
      description: one line saying what the model is.
    """

    name: str
    nodes: tuple[NodeCost, ...]
    cut_positions: tuple[int, ...]
    crossing_bytes: tuple[int, ...]
    input_bytes: int = 0
    checkpoint_positions: tuple[int, ...] | None = None
    activation_dtype_bytes: int = 4
    description: str = ""

    def __post_init__(self):
        if not self.nodes:
            raise ValueError(f"Model {self.name!r} has no nodes to estimate.")
        if len(self.crossing_bytes) != len(self.nodes) + 1:
            raise ValueError(
                f"crossing_bytes needs len(nodes) + 1 = {len(self.nodes) + 1} entries. "
                f"Received: {len(self.crossing_bytes)}"
            )
        bad = [p for p in self.cut_positions if not 0 < p < len(self.nodes)]
        if bad:
            raise ValueError(f"cut_positions must lie in (0, {len(self.nodes)}). Received: {bad}")

    @property
    def params(self) -> int:
        return sum(node.params for node in self.nodes)

    @property
    def flops(self) -> int:
        """Forward FLOPs per sample."""
        return sum(node.flops for node in self.nodes)

    @property
    def has_activations(self) -> bool:
        return any(node.kept_bytes for node in self.nodes)

    @property
    def max_stages(self) -> int:
        return len(self.cut_positions) + 1


@dataclass(frozen=True)
class TrainOptions:
    """The training settings that change memory and communication (config keys)."""

    micro_batch_size: int = 1  # samples per micro-batch and model replica
    zero: str = ""  # zero.level
    amp: str = ""  # amp.level, or "master" (see the module doc)
    gc: bool = False  # gradient_checkpoint.type set
    optimizer: str = "adam"

    def __post_init__(self):
        value = self.micro_batch_size
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"micro_batch_size must be an int >= 1. Received: micro_batch_size={value!r}"
            )
        choices = {
            "zero": ZERO_LEVELS,
            "amp": AMP_MODES,
            "optimizer": tuple(OPTIMIZER_SLOTS),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"{key} must be one of {allowed}. Received: {key}={getattr(self, key)!r}"
                )


@dataclass(frozen=True)
class StageEstimate:
    """The estimate for every device of one pipeline stage (they are identical)."""

    index: int
    devices: int  # devices running this stage in the whole job (its data-parallel degree)
    nodes: tuple[int, int]  # [start, stop) node indices
    params: int
    flops: float  # forward FLOPs per sample
    parameters: int  # bytes
    gradients: int  # bytes after the reduction (sharded by ZeRO v1)
    full_gradients: int  # bytes of the accumulated stage gradients before the reduction
    optimizer: int  # bytes
    activations: dict[str, int]  # per micro-batch: "fp32", "gc", "amp", "amp+gc"
    selected: str  # which of `activations` the options use
    inflight: int  # micro-batches whose activations a device keeps alive
    recompute: int  # bytes of the one segment recomputed at a time (gc only)
    workspace: int  # backward gradients of the largest node
    comm_buffers: int  # collective buffers of the gradient reduction
    comm_data_parallel: int  # bytes sent per step
    comm_pipeline: int  # bytes sent per step
    gathered: int = 0  # ZeRO v2: gathered whole parameters beyond the full gradients

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def activation_peak(self) -> int:
        return self.activations[self.selected] * self.inflight + self.recompute

    @property
    def peak(self) -> int:
        states = self.parameters + self.optimizer + max(self.gradients, self.full_gradients)
        return states + self.activation_peak + self.workspace + self.comm_buffers + self.gathered

    @property
    def comm(self) -> int:
        return self.comm_data_parallel + self.comm_pipeline


@dataclass(frozen=True)
class Estimate:
    """`estimate`'s result: one `StageEstimate` per stage, plus plan-wide numbers."""

    model: ModelCost
    plan: Plan
    options: TrainOptions
    stages: tuple[StageEstimate, ...]
    data_parallel: int
    cuts: tuple[int, ...] = field(default=())

    @property
    def bubble(self) -> float:
        plan = self.plan
        m, strategy, v = plan.num_micro_batch, plan.pipeline_strategy, plan.virtual_stages
        return bubble_fraction(len(self.stages), m, strategy, v)

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch_factor * self.options.micro_batch_size

    @property
    def max_peak(self) -> int:
        return max(stage.peak for stage in self.stages)

    @property
    def host_bytes(self) -> int:
        """Bytes every worker keeps in host memory beside its devices: the user's Keras
        model (its float32 variables) and the state of its optimizer, whole, where Keras's
        `model.save`, `ModelCheckpoint` and a later `model.fit` read them (the engine
        trains copies on the devices and writes them back: update/master_state.py). ZeRO
        shards the devices' copies, not this one."""
        slots = OPTIMIZER_SLOTS[self.options.optimizer]
        return 4 * self.model.params * (1 + slots)

    def worker_bytes(self, worker: int = 0) -> int:
        """Peak bytes of one worker whose devices share one memory (logical CPU
        devices, where the allocator's peak is process-wide): the sum of the peaks of
        the devices the plan places on it, plus `host_bytes`."""
        return self.host_bytes + sum(
            self.stages[k].peak * sum(device.worker == worker for device in devices)
            for row in self.plan.placement
            for k, devices in enumerate(row)
        )

    def to_dict(self) -> dict:
        """JSON-serialisable numbers (what `epl-plan --json` prints)."""
        return {
            "model": self.model.name,
            "params": self.model.params,
            "data_parallel": self.data_parallel,
            "num_stages": len(self.stages),
            "global_batch": self.global_batch,
            "bubble_fraction": self.bubble,
            "host_bytes_per_worker": self.host_bytes,
            "cuts": list(self.cuts),
            "options": {
                **dataclasses.asdict(self.options),
                "num_micro_batch": self.plan.num_micro_batch,
                "pipeline_strategy": self.plan.pipeline_strategy,
            },
            "stages": [
                {
                    "index": s.index,
                    "devices": s.devices,
                    "params": s.params,
                    "flops_per_sample": s.flops,
                    "parameters": s.parameters,
                    "gradients": s.gradients,
                    "optimizer": s.optimizer,
                    "model_states": s.model_states,
                    "activations_per_micro_batch": s.activations,
                    "inflight_micro_batches": s.inflight,
                    "activation_peak": s.activation_peak,
                    "workspace": s.workspace,
                    "comm_buffers": s.comm_buffers,
                    "peak": s.peak,
                    "comm_data_parallel": s.comm_data_parallel,
                    "comm_pipeline": s.comm_pipeline,
                }
                for s in self.stages
            ],
        }


# ------------------------------------------------------------------ arithmetic
def model_state_bytes(
    params: float, data_parallel: int, zero: str = "", amp: str = "", optimizer: str = "adam"
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes per device for `params` parameters
    replicated over `data_parallel` devices (see the table in the module doc)."""
    options = TrainOptions(zero=zero, amp=amp, optimizer=optimizer)  # validates
    slots = OPTIMIZER_SLOTS[options.optimizer]
    if amp == "master":
        param_b, grad_b, optimizer_b = 2, 2, 4 + 4 * slots
    else:
        param_b, grad_b, optimizer_b = 4, 4, 4 * slots
    n = data_parallel
    gradients = params * grad_b / (n if zero in ("v1", "v2") else 1)
    if zero == "v2":
        # The shards are the parameters (float32 under "" / "O1", whose optimizer then
        # needs no master copy; the paper's 16-bit copy under "master").
        return params * param_b / n, gradients, params * optimizer_b / n
    if zero in ("v0", "v1"):
        # Each shard's optimizer runs on a float32 copy of its rows (zero.py), the master
        # partition "master" AMP already counts.
        state = params * (optimizer_b + (4 if amp != "master" else 0)) / n
    else:
        state = params * optimizer_b
    return params * param_b, gradients, state


def balanced_cuts(
    costs: Sequence[float],
    params: Sequence[float],
    candidates: Sequence[int],
    num_stages: int,
) -> tuple[int, ...]:
    """The `num_stages - 1` candidate positions that minimise the largest stage cost.

    Exact dynamic program over the candidates (O(S * C^2), vectorised over one axis).
    Among partitions with the optimal largest cost, the one with the smallest largest
    stage parameter count wins; then the earliest cuts.

    Args:
      costs, params: per node, in node order.
      candidates: node indices in (0, len(costs)) where a stage may start.
      num_stages: S, with 1 <= S <= len(candidates) + 1.

    Returns:
      Ascending node indices where stages 1..S-1 start.
    """
    n = len(costs)
    positions = sorted(set(candidates))
    if positions and not 0 < positions[0] <= positions[-1] < n:
        raise ValueError(f"candidates must lie in (0, {n}). Received: {positions}")
    if not 1 <= num_stages <= len(positions) + 1:
        raise ValueError(
            f"num_stages must be in [1, {len(positions) + 1}] for {len(positions)} "
            f"candidate cut(s). Received: num_stages={num_stages}"
        )
    bounds = np.array([0, *positions, n])
    cost_prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))[bounds]
    param_prefix = np.concatenate(([0.0], np.cumsum(np.asarray(params, dtype=np.float64))))[bounds]
    bottleneck, _ = _min_max_dp(cost_prefix, None, np.inf, num_stages)
    limit = bottleneck * (1 + _TIE_RTOL) + _TIE_RTOL
    _, chosen = _min_max_dp(param_prefix, cost_prefix, limit, num_stages)
    return tuple(int(bounds[i]) for i in chosen[1:-1])


def _min_max_dp(objective, constraint, limit: float, num_stages: int):
    """Minimises the largest segment sum of `objective` (prefix sums at the candidate
    bounds) over partitions into `num_stages` segments whose `constraint` segment sums
    stay <= limit. Returns (value, bound indices including 0 and the last)."""
    m = len(objective)
    last = m - 1

    def segment_ok(t):
        if constraint is None:
            return np.ones(t, dtype=bool)
        return constraint[t] - constraint[:t] <= limit

    best = np.full(m, np.inf)  # best[t]: bounds 0..t covered by the stages so far
    best[1:] = objective[1:] - objective[0]
    if constraint is not None:
        best[1:] = np.where(constraint[1:] - constraint[0] <= limit, best[1:], np.inf)
    choices = []
    for _ in range(1, num_stages):
        new = np.full(m, np.inf)
        choice = np.zeros(m, dtype=np.int64)
        for t in range(1, m):
            options = np.maximum(best[:t], objective[t] - objective[:t])
            options = np.where(segment_ok(t), options, np.inf)
            i = int(np.argmin(options))
            new[t], choice[t] = options[i], i
        best = new
        choices.append(choice)
    chosen = [last]
    for choice in reversed(choices):
        chosen.append(int(choice[chosen[-1]]))
    chosen.append(0)
    return float(best[last]), chosen[::-1]


def partition_stages(model: ModelCost, num_stages: int) -> tuple[int, ...]:
    """Where stages 1..S-1 start: balanced forward FLOPs over `model.cut_positions`.

    The automatic stage partition of the trainer calls this too, so `epl-plan` and
    `auto.auto_parallel` cut the same model the same way.
    """
    if num_stages > model.max_stages:
        raise ValueError(
            f"Cannot cut {num_stages} stages from model {model.name!r}: it has "
            f"{len(model.cut_positions)} cut point(s), so at most {model.max_stages} "
            f"stage(s). Received: num_stages={num_stages}"
        )
    return balanced_cuts(
        [n.flops for n in model.nodes], [n.params for n in model.nodes],
        model.cut_positions, num_stages,
    )  # fmt: skip


def virtual_cluster(num_workers: int, devices_per_worker: int, device_type: str = "GPU"):
    """Device names of a cluster that need not exist, for `planner.build_plan`."""
    for key, value in (("num_workers", num_workers), ("devices_per_worker", devices_per_worker)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{key} must be an int >= 1. Received: {key}={value!r}")
    return [
        [
            f"/job:worker/replica:0/task:{w}/device:{device_type}:{d}"
            for d in range(devices_per_worker)
        ]
        for w in range(num_workers)
    ]


# ------------------------------------------------------------------ the estimate
def estimate(
    model: ModelCost,
    plan: Plan,
    options: TrainOptions,
    cuts: Sequence[int] | None = None,
) -> Estimate:
    """Per-stage (= per-device) memory and communication of `model` trained on `plan`.

    Args:
      model: the model's costs.
      plan: one TaskGraph per pipeline stage (each `replicate`), with the micro-batches
        per step and the pipeline schedule (`num_micro_batch`, `pipeline_strategy`).
      options: micro-batch size (per model replica; `replicate(n)` gives each of its n
        devices 1/n), ZeRO level, AMP, gradient checkpointing, optimizer.
      cuts: node indices where stages 1.. start; default `partition_stages`.

    Raises:
      ValueError: a plan the estimate does not describe, or cuts that do not fit it.
    """
    num_stages = plan.num_taskgraphs
    if any(tg.kind != "replicate" for tg in plan.taskgraphs):
        raise ValueError(
            "The estimate covers replicate TaskGraphs (data and pipeline parallelism). "
            f"Received kinds: {[tg.kind for tg in plan.taskgraphs]}"
        )
    cuts = partition_stages(model, num_stages) if cuts is None else tuple(cuts)
    if len(cuts) != num_stages - 1:
        raise ValueError(
            f"{num_stages} stages need {num_stages - 1} cut(s). Received: cuts={list(cuts)}"
        )
    bounds = (0, *cuts, len(model.nodes))
    # The schedule the trainer runs, as data: how many micro-batches each stage keeps.
    m, v = plan.num_micro_batch, plan.virtual_stages
    in_flight = _in_flight(plan.pipeline_strategy, num_stages, m, v)
    if loops_micro_batches(num_stages, m, options.zero):
        in_flight = (LOOPED_IN_FLIGHT,)
    stages = tuple(
        _stage(model, plan, options, k, start, stop, in_flight)
        for k, (start, stop) in enumerate(itertools.pairwise(bounds))
    )
    return Estimate(model, plan, options, stages, plan.num_replicas, tuple(cuts))


# Micro-batches a looped stage keeps alive: the loop's current one and the last one.
LOOPED_IN_FLIGHT = 2


def loops_micro_batches(num_stages: int, num_micro_batch: int, zero: str) -> bool:
    """Whether the engine runs the micro-batches as a loop (`Program.loops_micro_batches`):
    one stage, several micro-batches, and no ZeRO level that reduces each micro-batch's
    gradients as its backward makes them (v1, v2: the micro-batches then run in turn).
    Synchronized BatchNorm and split layers also turn the loop off; the estimate has
    neither."""
    return num_stages == 1 and num_micro_batch > 1 and zero not in ("v1", "v2")


@functools.lru_cache(maxsize=256)
def _in_flight(strategy: str, num_stages: int, num_micro_batch: int, virtual_stages: int):
    """`peak_in_flight` of the schedule, once per shape (a layout search estimates
    thousands of layouts). With one stage per device the counts have closed forms
    (`schedule.peak_in_flight`'s doc; tests/test_plan_step_time.py checks them against the
    built schedules): a search over 64 stages x 512 micro-batches need not build each."""
    s, m = num_stages, num_micro_batch
    if virtual_stages == 1 and strategy == "PreferForward":
        return (m,) * s
    if virtual_stages == 1 and strategy == "PreferBackward":
        return tuple(min(s - stage, m) for stage in range(s))
    if virtual_stages == 1 and strategy == "ZeroBubbleH1":
        return (min(s, m),) * s
    schedule = make_schedule(strategy, num_stages, num_micro_batch, virtual_stages)
    return tuple(peak_in_flight(schedule))


def _stage(model, plan: Plan, options: TrainOptions, k, start, stop, in_flight):
    nodes = model.nodes[start:stop]
    num_stages, m = plan.num_taskgraphs, plan.num_micro_batch
    # A stage's devices each hold a full copy of its variables (replicate(n) lanes too),
    # and replicate(n) splits the replica's micro-batch over its n devices.
    width = plan.taskgraphs[k].device_count
    n = plan.num_replicas * width
    mb = options.micro_batch_size / width
    params = sum(node.params for node in nodes)
    parameters, gradients, optimizer = model_state_bytes(
        params, n, options.zero, options.amp, options.optimizer
    )
    full_gradients = model_state_bytes(params, 1, "", options.amp, options.optimizer)[1]
    low = 2 / model.activation_dtype_bytes  # 16-bit activations under AMP
    stage_input = model.input_bytes if k == 0 else model.crossing_bytes[start]
    plain = sum(node.kept_bytes for node in nodes)
    # Under AMP the activations are 16-bit except what layers keep in float32.
    plain_amp = sum(amp_bytes(node, low) for node in nodes)
    kept, segment, segment_amp, segment_params = _checkpointed(model, start, stop, low)
    # A later stage's input is an activation (16-bit under AMP); the first stage's is data.
    low_input = stage_input * (low if k > 0 else 1)
    activations = {
        "fp32": mb * (stage_input + plain),
        "gc": mb * (stage_input + kept),
        "amp": mb * (low_input + plain_amp),
        "amp+gc": mb * (low_input + kept * low),
    }
    scale = low if options.amp else 1.0
    selected = (
        ("amp" if options.amp else "fp32")
        if not options.gc
        else ("amp+gc" if options.amp else "gc")
    )
    inflight = in_flight[k]
    largest = max(node.largest_tensor for node in nodes)
    # Ring collectives: each device sends 2(N-1)/N of an all-reduce buffer, (N-1)/N of
    # a reduce-scatter or all-gather buffer.
    share = (n - 1) / n
    wire = full_gradients  # gradients travel in their own dtype
    gathered = 0
    if options.zero == "v2":
        whole_parameters = model_state_bytes(params, 1, "", options.amp, options.optimizer)[0]
        # The whole stage once per step, or (checkpointing) a segment and the next one's
        # prefetch. A layer's gathered weights are freed as its gradients appear, so the
        # two share one copy, unless micro-batches share the step's gather.
        gathered = 4 * (segment_params if options.gc else params)
        if options.gc or m == 1:
            gathered = max(0.0, gathered - full_gradients)
        gathers = 2 * m if options.gc else 1
        comm_dp = share * wire * m + gathers * share * whole_parameters
    elif options.zero == "v1":
        comm_dp = share * wire + share * parameters
    elif options.zero == "v0":
        comm_dp = 2 * share * wire + share * parameters
    else:
        comm_dp = 2 * share * wire
    sends = (model.crossing_bytes[stop] if k < num_stages - 1 else 0) + (
        model.crossing_bytes[start] if k > 0 else 0
    )
    return StageEstimate(
        index=k,
        devices=n,
        nodes=(start, stop),
        params=params,
        flops=float(sum(node.flops for node in nodes)),
        parameters=round(parameters),
        gradients=round(gradients),
        full_gradients=round(full_gradients),
        optimizer=round(optimizer),
        activations={key: round(value) for key, value in activations.items()},
        selected=selected,
        inflight=inflight,
        recompute=round(mb * (segment_amp if options.amp else segment)) if options.gc else 0,
        workspace=round(2 * mb * largest * scale),
        comm_buffers=0 if n == 1 else round(wire),
        gathered=round(gathered),
        comm_data_parallel=round(comm_dp) if n > 1 else 0,
        comm_pipeline=round(sends * mb * m * scale),
    )


def _checkpointed(model: ModelCost, start: int, stop: int, low: float):
    """(bytes kept at checkpoint boundaries inside [start, stop), largest segment's
    activation bytes, the same under AMP, per sample; the most parameters two
    neighbouring segments hold)."""
    edges = checkpoint_segments(model, start, stop)
    kept = sum(model.crossing_bytes[a] for a, _ in edges[1:])
    nodes = model.nodes
    segment = max(sum(node.kept_bytes for node in nodes[a:b]) for a, b in edges)
    segment_amp = max(sum(amp_bytes(node, low) for node in nodes[a:b]) for a, b in edges)
    # Parameters of two neighbouring segments (one gathered while the other computes).
    per_segment = [sum(node.params for node in nodes[a:b]) for a, b in edges]
    pairs = [a + b for a, b in itertools.pairwise(per_segment)] or per_segment
    return kept, segment, segment_amp, max(pairs)


def checkpoint_segments(model: ModelCost, start: int, stop: int) -> list[tuple[int, int]]:
    """(first, end) node indices of the gradient-checkpointing segments of the stage
    [start, stop): cut at `model.checkpoint_positions` (default: `cut_positions`)."""
    positions = model.checkpoint_positions
    positions = model.cut_positions if positions is None else positions
    inner = sorted(p for p in positions if start < p < stop)
    return list(itertools.pairwise([start, *inner, stop]))


def recomputed_nodes(model: ModelCost, start: int, stop: int) -> list[int]:
    """Indices of the nodes of the stage [start, stop) whose forward a checkpointed
    backward runs again. Each segment's backward differentiates its recomputed forward,
    and TensorFlow runs only the ops whose outputs something reads: a node's forward
    runs again if its own backward reads its output, or the node after it (in a
    segment's order; the segment's output itself is the next segment's kept input)
    reads its input or runs again. A transformer block ending in a residual add skips
    the add and the linear projection before it (`bench/plan_accuracy.py` rows 2, 7,
    15, 20)."""
    again = []
    for first, end in checkpoint_segments(model, start, stop):
        read_after = False  # whether the nodes after this one read its output
        for index in range(end - 1, first - 1, -1):
            node = model.nodes[index]
            runs = node.backward_reads_output or read_after
            if runs:
                again.append(index)
            read_after = runs or node.backward_reads_inputs
    return sorted(again)


def amp_bytes(node: NodeCost, low: float) -> float:
    """A node's kept bytes per sample under AMP: 16-bit but for its float32 part."""
    return (node.kept_bytes - node.float32_bytes) * low + node.float32_bytes
