"""The devices epl-plan knows: peak rates, memory, links, each constant with its source.

One table (`DEVICES`) holds every constant the step-time model (`step_time.py`) uses; the
same constants serve every prediction, measured or published (`bench/plan_accuracy.py`,
`bench/plan_published.py`): nothing is fitted to a row. `--device NAME` picks an entry;
`--peak_tflops` / `--device_memory` replace its peak or memory, or describe a device the
table lacks (`custom_device`).

Conventions: FLOP/s are dense (no structured sparsity). A link's bandwidth is bytes per
second one device sends in one direction. `inter_node_bandwidth` is a node's total over its
network adapters: NCCL runs one ring per adapter, so a collective across nodes moves at the
node's total divided over its devices' rings. Ring collectives send 2(N-1)/N of a buffer
(all-reduce) or (N-1)/N (reduce-scatter, all-gather) per device, and take 2(N-1) or N-1
latency-bound steps.

The "cpu" entry is a machine of logical CPU devices sharing its cores: the rates the
microbenchmarks of `bench/plan_calibrate.py` measured, which `--write` stores with their
date and the CPU they ran on in `cpu_calibration.json` beside this file. A CPU of another
kind runs at other rates (a Zen 5 core ran the zoo's transformer twice as fast as the
core calibrated before it): recalibrate there before trusting the "cpu" step times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os

__all__ = ["DEVICES", "DeviceSpec", "custom_device", "device_by_name", "sources_table"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the node it comes in.

    Attributes:
      name: the `--device` name.
      peak_flops: dense 16-bit (bfloat16 / float16) FLOP/s, the MFU denominator.
      peak_flops_fp32: FLOP/s of float32 matmuls (TF32 tensor cores where TensorFlow uses
        them by default, Ampere and later).
      memory_bytes: device memory.
      memory_bandwidth: bytes/s of the device memory (elementwise ops are bound by it).
      matmul_efficiency: the share of the peak a large matmul reaches (a microbenchmark of
        the best shape: `step_time.py` lowers it for a shape's wave quantization).
      batched_matmul_efficiency: the share of the matmul rate that each sample's own
        small products reach (attention's per head, `analytic.Gemm` with stacked=False),
        forward and backward, beyond what the roofline and waves count (1: none).
      sm_count: streaming multiprocessors, what a matmul's output tiles are spread over in
        waves (0: no wave quantization, as on a CPU).
      memory_efficiency: the share of `memory_bandwidth` a streaming kernel reaches (a
        microbenchmark): elementwise ops, memory-bound matmuls and the optimizer run at it.
      elementwise_speedups: for a shared pool, measured (devices, factor) points: the
        bytes per second a layer's elementwise ops move over its activations, relative to
        the streaming rates of that many devices (`elementwise_factor`; no points: 1, a
        GPU's activations outgrow its caches). On a CPU whose caches hold a layer's
        activations, its ops read what the op before wrote.
      matmul_tiles: (rows, columns) of the output tiles the matmul library picks among (one
        thread block each); `step_time.py` takes the one that wastes least of a wave.
      intra_node_bandwidth: bytes/s per device and direction between devices of a node.
      intra_node_efficiency: the share of `intra_node_bandwidth` NCCL's collectives and
        sends reach over it (its protocol overhead, nccl-tests' bus bandwidth).
      inter_node_bandwidth: bytes/s per node and direction over its network adapters.
      devices_per_node: devices per node (collectives within them use the intra link).
      latency_s: seconds per step of a ring collective or one send.
      host_bandwidth: bytes/s per device to and from host memory (offload).
      host_memory_bandwidth: bytes/s of host memory per device (its share of the node's
        CPU sockets), what an offloaded optimizer update is bound by.
      layer_overhead_s: seconds per layer and training step that do not scale with its
        FLOPs or bytes (kernel launches, the runtime's per-op cost): forward, backward and
        update together.
      step_overhead_s: seconds per step that no layer accounts for.
      shares_compute: the node's devices share one compute pool (logical CPU devices):
        their work adds up on its cores instead of running side by side.
      cores: cores of the shared pool (`shares_compute`).
      pool_overhead: for a shared pool, measured (devices, seconds per layer for all of
        them, seconds per step) points; `pool_overheads` interpolates them.
      pool_matmul_flops, pool_memory_bandwidth: for a shared pool, measured (devices,
        FLOP/s or bytes/s of all of them side by side) points, each device with the
        trainer's threads per op (`pool_rates`); the first point is one device's.
      thread_matmul_flops, thread_memory_bandwidth: for a shared pool, the rates of one
        device with one thread per op (what each of several devices runs at while the
        others idle: `device_rates`); 0: its share of the pool's.
      thread_pair_matmul_flops: for a shared pool, FLOP/s of a backward's input and
        weight gradients (independent products) on one device with one thread per op,
        the others idle: the runtime's inter-op threads run the two side by side
        (`device_pair_rate`); 0: `thread_matmul_flops`.
      collective_speed: a collective kind's ("reduce_scatter", "all_gather") bytes sent
        per second relative to the all-reduce's (1 where not given: NCCL's rings move
        every kind at the link's bandwidth).
      sources: constant name -> where its value comes from.
    """

    name: str
    peak_flops: float
    peak_flops_fp32: float
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    latency_s: float
    host_bandwidth: float
    host_memory_bandwidth: float = 0.0
    sm_count: int = 0
    matmul_tiles: tuple = ()
    memory_efficiency: float = 1.0
    batched_matmul_efficiency: float = 1.0
    elementwise_speedups: tuple = ()
    intra_node_efficiency: float = 1.0
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    shares_compute: bool = False
    cores: int = 1
    pool_overhead: tuple = ()
    pool_matmul_flops: tuple = ()
    pool_memory_bandwidth: tuple = ()
    thread_matmul_flops: float = 0.0
    thread_memory_bandwidth: float = 0.0
    thread_pair_matmul_flops: float = 0.0
    collective_speed: dict = dataclasses.field(default_factory=dict, compare=False)
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        for key in ("peak_flops", "peak_flops_fp32", "memory_bytes", "memory_bandwidth"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a positive number. Received: {key}={value!r}")
        for key in ("matmul_efficiency", "memory_efficiency", "batched_matmul_efficiency",
                    "intra_node_efficiency"):  # fmt: skip
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"{key} must be in (0, 1]. Received: {key}={value!r}")
        if any(not factor > 0 for _, factor in self.elementwise_speedups):
            raise ValueError(
                "elementwise_speedups must be (devices, factor > 0) points. Received: "
                f"elementwise_speedups={self.elementwise_speedups!r}"
            )
        sms = self.sm_count
        if isinstance(sms, bool) or not isinstance(sms, int) or sms < 0:
            raise ValueError(f"sm_count must be an int >= 0. Received: sm_count={sms!r}")

    def pool_overheads(self, devices: int) -> tuple[float, float]:
        """(seconds per layer for all `devices` together, seconds per step) on a shared
        pool: the measured points interpolated linearly, extended by the last two."""
        points = sorted(self.pool_overhead) or [(1, self.layer_overhead_s, self.step_overhead_s)]
        if len(points) == 1:
            _, layer, step = points[0]
            return layer * devices, step
        return _interpolated(points, devices)

    def pool_rates(self, devices: int) -> tuple[float, float]:
        """(matmul FLOP/s, streaming bytes/s) of `devices` logical devices side by side on
        a shared pool, all of them together: the measured points interpolated, and beyond
        the last one its rates (the pool is full). Without points: one device's rates,
        shared."""
        one = (self.flops_rate(""), self.streaming_bandwidth)
        flops = sorted(self.pool_matmul_flops) or [(1, one[0])]
        bandwidth = sorted(self.pool_memory_bandwidth) or [(1, one[1])]
        return tuple(
            _interpolated(points, min(devices, points[-1][0]))[0] if len(points) > 1
            else points[0][1]
            for points in (flops, bandwidth)
        )  # fmt: skip

    def elementwise_factor(self, devices: int) -> float:
        """How much faster than the streaming rates `devices` devices' elementwise ops
        move a layer's activations: the measured points interpolated, beyond the last one
        its factor; 1 without points."""
        points = sorted(self.elementwise_speedups)
        if not points:
            return 1.0
        if len(points) == 1:
            return points[0][1]
        return _interpolated(points, min(devices, points[-1][0]))[0]

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves: the datasheet's bandwidth x the share a
        streaming microbenchmark reaches."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def nvlink_bandwidth(self) -> float:
        """Bytes/s per device and direction a collective or send moves within a node."""
        return self.intra_node_bandwidth * self.intra_node_efficiency

    def flops_rate(self, amp: str) -> float:
        """FLOP/s of matmuls in the step's compute dtype (16-bit with AMP)."""
        return self.matmul_efficiency * (self.peak_flops if amp else self.peak_flops_fp32)


def _interpolated(points, devices: float) -> tuple:
    """The values of sorted (devices, *values) points at `devices`: linear between two
    points, extended by the last two beyond them."""
    for (n0, *v0), (n1, *v1) in itertools.pairwise(points):
        if devices <= n1 or n1 == points[-1][0]:
            share = (devices - n0) / (n1 - n0)
            return tuple(a + share * (b - a) for a, b in zip(v0, v1))
    raise AssertionError(points)


def device_rates(spec: DeviceSpec, devices: int) -> tuple[float, float]:
    """(matmul FLOP/s, streaming bytes/s) of one of `devices` logical devices of a shared
    pool when it runs on its own: the whole pool's for one device (all cores in each op),
    one thread's from two devices on (cores // devices threads per op)."""
    flops, bandwidth = spec.pool_rates(devices)
    if devices == 1:
        return flops, bandwidth
    share = min(devices, spec.cores)
    return (spec.thread_matmul_flops or flops / share,
            spec.thread_memory_bandwidth or bandwidth / share)  # fmt: skip


def device_pair_rate(spec: DeviceSpec, devices: int) -> float:
    """FLOP/s of a backward's two independent products (input and weight gradients) on
    one of `devices` logical devices of a shared pool running on its own: from two
    devices on (one thread per op) the inter-op threads run the two side by side
    (`thread_pair_matmul_flops`); one device's ops already use every core, and two side
    by side went no faster (the same products on one device, the trainer's threads,
    timed one after the other and side by side: 155-186 and 156-172 GFLOP/s)."""
    rate = device_rates(spec, devices)[0]
    if devices == 1 or not spec.thread_pair_matmul_flops:
        return rate
    return max(rate, spec.thread_pair_matmul_flops)


# ----------------------------------------------------------------- sources
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
_V100 = "NVIDIA Tesla V100 datasheet (SXM2/SXM3)"
_MAMF = (
    "Maximum Achievable Matmul FLOPS, S. Bekman, ml-engineering (compute/accelerator, "
    "mamf-finder.py): best bf16 matmul over shapes"
)
_NO_LAUNCH = "0: CUDA launches are asynchronous; kernels longer than a launch hide it"
_PCIE4 = "PCIe 4.0 x16: 32 GB/s per direction (A100 SXM host link)"
_TILES = ((256, 128), (128, 256), (128, 128))
_TILES_SOURCE = (
    "NVIDIA Matrix Multiplication Background User's Guide (DU-09799-001), 2.3 and 3: "
    "cuBLAS's typical large tiles 256x128, 128x256 and 128x128 (smaller ones trade data "
    "reuse for fewer idle SMs); each tile is a thread block, run in waves of one per SM "
    "(3.2, wave quantization; its A100 example: 108 SMs, 256x128 tiles)"
)
_STREAM = (
    "NVIDIA developer forum, 'Trouble to reach peak bandwidth of A100' (2025): a read "
    "kernel on an A100 80GB SXM moves 1.80 of the datasheet's 2.04 TB/s (88%, Nsight "
    "Compute agrees), and the GTC talk it cites finds no kernel above about 90%"
)
_NCCL_PROTOCOL = (
    "NCCL's protocol overhead: ~20% of the NVLink line rate (NCCL maintainer, "
    "nvidia/nccl-tests#212: 370 of H100's 450 GB/s); nccl-tests on 8 x A100-80GB over "
    "NVLink measure an all-reduce bus bandwidth of ~200 of 300 GB/s (nvidia/nccl-tests#149)"
)

DEVICES: dict[str, DeviceSpec] = {}


def _add(spec: DeviceSpec) -> None:
    DEVICES[spec.name] = spec


_add(
    DeviceSpec(
        name="a100-80gb",
        peak_flops=312e12,
        peak_flops_fp32=156e12,
        memory_bytes=80 * GB,
        memory_bandwidth=2039 * GB,
        matmul_efficiency=267.9 / 312,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=8 * 25 * GB,
        devices_per_node=8,
        latency_s=5e-6,
        host_bandwidth=32 * GB,
        host_memory_bandwidth=2 * 204.8 * GB / 8,
        sm_count=108,
        matmul_tiles=_TILES,
        memory_efficiency=0.88,
        intra_node_efficiency=0.8,
        sources={
            "peak_flops": f"{_A100}: 312 TFLOP/s bf16/fp16 dense",
            "sm_count": "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs",
            "matmul_tiles": _TILES_SOURCE,
            "memory_efficiency": f"0.88: {_STREAM}",
            "intra_node_efficiency": f"0.8: {_NCCL_PROTOCOL}",
            "peak_flops_fp32": f"{_A100}: 156 TFLOP/s TF32 dense",
            "memory": f"{_A100}: 80 GB HBM2e, 2,039 GB/s",
            "matmul_efficiency": f"{_MAMF}: A100 SXM 267.9 of 312 TFLOP/s",
            "intra_node_bandwidth": f"{_A100}: NVLink 600 GB/s both directions = 300 each",
            "inter_node_bandwidth": "DGX A100 user guide: 8 x 200 Gb/s HDR InfiniBand "
            "(compute) = 200 GB/s per node and direction",
            "latency_s": "assumed 5 us per ring step (NCCL over NVLink/IB: microseconds); "
            "negligible against the megabyte messages of the rows here",
            "host_bandwidth": _PCIE4,
            "host_memory_bandwidth": "DGX A100: 2 AMD EPYC 7742, 8 x DDR4-3200 each "
            "(204.8 GB/s per socket), shared by 8 GPUs",
            "layer_overhead_s": _NO_LAUNCH,
        },
    )
)
_add(
    dataclasses.replace(
        DEVICES["a100-80gb"],
        name="a100-40gb",
        memory_bytes=40 * GB,
        memory_bandwidth=1555 * GB,
        sources={**DEVICES["a100-80gb"].sources, "memory": f"{_A100}: 40 GB HBM2, 1,555 GB/s"},
    )
)
_add(
    DeviceSpec(
        name="h100",
        peak_flops=989e12,
        peak_flops_fp32=494.5e12,
        memory_bytes=80 * GB,
        memory_bandwidth=3350 * GB,
        matmul_efficiency=792.1 / 989,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=8 * 50 * GB,
        devices_per_node=8,
        latency_s=5e-6,
        host_bandwidth=64 * GB,
        host_memory_bandwidth=2 * 307.2 * GB / 8,
        sm_count=132,
        matmul_tiles=_TILES,
        memory_efficiency=0.88,
        intra_node_efficiency=0.8,
        sources={
            "sm_count": f"{_H100}: 132 SMs",
            "matmul_tiles": _TILES_SOURCE,
            "memory_efficiency": "0.88: the A100's measured share (no H100 microbenchmark "
            "found), an assumption",
            "intra_node_efficiency": f"0.8: {_NCCL_PROTOCOL}",
            "peak_flops": f"{_H100}: 989 TFLOP/s bf16 dense (1,979 with sparsity)",
            "peak_flops_fp32": f"{_H100}: 494.5 TFLOP/s TF32 dense",
            "memory": f"{_H100}: 80 GB HBM3, 3.35 TB/s",
            "matmul_efficiency": f"{_MAMF}: H100 SXM 792.1 of 989 TFLOP/s",
            "intra_node_bandwidth": f"{_H100}: NVLink 900 GB/s both directions = 450 each",
            "inter_node_bandwidth": "DGX H100: 8 x 400 Gb/s NDR InfiniBand = 400 GB/s per node",
            "latency_s": "assumed 5 us per ring step, as for the A100",
            "host_bandwidth": "PCIe 5.0 x16: 64 GB/s per direction",
            "host_memory_bandwidth": "DGX H100: 2 Xeon 8480C, 8 x DDR5-4800 each "
            "(307.2 GB/s per socket), shared by 8 GPUs",
            "layer_overhead_s": _NO_LAUNCH,
        },
    )
)
_add(
    DeviceSpec(
        name="v100",
        peak_flops=125e12,
        peak_flops_fp32=15.7e12,
        memory_bytes=32 * GB,
        memory_bandwidth=900 * GB,
        matmul_efficiency=83 / 125,
        intra_node_bandwidth=150 * GB,
        inter_node_bandwidth=8 * 12.5 * GB,
        devices_per_node=16,
        latency_s=5e-6,
        host_bandwidth=16 * GB,
        host_memory_bandwidth=2 * 127.8 * GB / 16,
        sm_count=80,
        matmul_tiles=_TILES,
        memory_efficiency=0.88,
        intra_node_efficiency=0.8,
        sources={
            "sm_count": f"{_V100}: 80 SMs",
            "matmul_tiles": _TILES_SOURCE,
            "memory_efficiency": "0.88: the A100's measured share (no V100 microbenchmark "
            "found), an assumption",
            "intra_node_efficiency": f"0.8: {_NCCL_PROTOCOL}",
            "peak_flops": f"{_V100}: 125 TFLOP/s fp16 tensor cores",
            "peak_flops_fp32": f"{_V100}: 15.7 TFLOP/s float32",
            "memory": f"{_V100}: 32 GB HBM2, 900 GB/s",
            "matmul_efficiency": "Markidis et al., 'NVIDIA Tensor Core Programmability, "
            "Performance & Precision' (IPDPSW 2018, arXiv 1803.04014): cuBLAS's mixed-"
            "precision GEMM on a Tesla V100 reaches up to 83 of the 125 TFLOP/s the paper "
            "gives as its peak (no MAMF for the V100; 2018's cuBLAS, the ZeRO paper's era)",
            "intra_node_bandwidth": "DGX-2: NVSwitch, 300 GB/s NVLink per GPU both "
            "directions = 150 each; 16 GPUs per node",
            "inter_node_bandwidth": "DGX-2: 8 x 100 Gb/s EDR InfiniBand = 800 Gb/s per node "
            "(the ZeRO paper's 400-GPU cluster, section 10)",
            "latency_s": "assumed 5 us per ring step",
            "host_bandwidth": "PCIe 3.0 x16: 16 GB/s per direction",
            "host_memory_bandwidth": "DGX-2: 2 Xeon 8168, 6 x DDR4-2666 each (127.8 GB/s "
            "per socket), shared by 16 GPUs",
            "layer_overhead_s": _NO_LAUNCH,
        },
    )
)

# This machine (bench/plan_calibrate.py). Logical CPU devices share the cores: a
# collective between them is a copy in the same memory, a host "transfer" is free.
CPU_CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), "cpu_calibration.json")


def read_cpu_calibration(path: str = CPU_CALIBRATION_FILE) -> dict:
    """`bench/plan_calibrate.py --write`'s measurements: each rate, the pools' (devices,
    rate) pairs as tuples, the date ("measured") and the CPU ("machine")."""

    def frozen(value):
        return tuple(frozen(v) for v in value) if isinstance(value, list) else value

    with open(path) as f:
        return {key: frozen(value) for key, value in json.load(f).items()}


def this_cpu() -> dict:
    """What kind of CPU this is: /proc/cpuinfo's model name, family and model on Linux
    (the name alone does not tell an AMD EPYC's generations apart), `platform`'s
    elsewhere; and its cores."""
    import platform

    fields = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block describes them all
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return {"cpu": name, "cores": os.cpu_count()}


def stale_cpu_calibration() -> str:
    """Why the "cpu" entry may not describe this machine ('' when it does): its rates
    were measured on another kind of CPU or core count."""
    here, there = this_cpu(), _CPU_MEASURED["machine"]
    if here == there:
        return ""
    return (f"the \"cpu\" device was calibrated on {there['cpu']} with {there['cores']} cores, "
            f"this is {here['cpu']} with {here['cores']}: its step times describe that "
            "machine (python bench/plan_calibrate.py --write recalibrates)")


_CPU_MEASURED = read_cpu_calibration()
_CALIBRATED = "bench/plan_calibrate.py"
# A layer's elementwise ops against the adds of 2**22 float32, on as many devices.
_CPU_ELEMENTWISE = tuple(
    (n, layer_norm / adds)
    for (n, layer_norm), (_, adds) in zip(
        _CPU_MEASURED["pool_layer_norm_bandwidth"], _CPU_MEASURED["pool_memory_bandwidth"]
    )
)
_add(
    DeviceSpec(
        name="cpu",
        peak_flops=_CPU_MEASURED["matmul_flops"],
        peak_flops_fp32=_CPU_MEASURED["matmul_flops"],
        memory_bytes=16 * GB,
        memory_bandwidth=_CPU_MEASURED["memory_bandwidth"],
        matmul_efficiency=1.0,
        intra_node_bandwidth=_CPU_MEASURED["collective_bandwidth"],
        inter_node_bandwidth=_CPU_MEASURED["collective_bandwidth"],
        devices_per_node=64,
        latency_s=_CPU_MEASURED["collective_latency_s"] / 2,
        host_bandwidth=_CPU_MEASURED["memory_bandwidth"],
        host_memory_bandwidth=_CPU_MEASURED["memory_bandwidth"],
        layer_overhead_s=_CPU_MEASURED["pool_overhead"][0][1],
        step_overhead_s=_CPU_MEASURED["pool_overhead"][0][2],
        shares_compute=True,
        cores=2,
        pool_overhead=_CPU_MEASURED["pool_overhead"],
        pool_matmul_flops=_CPU_MEASURED["pool_matmul_flops"],
        pool_memory_bandwidth=_CPU_MEASURED["pool_memory_bandwidth"],
        thread_matmul_flops=_CPU_MEASURED["thread_matmul_flops"],
        thread_memory_bandwidth=_CPU_MEASURED["thread_memory_bandwidth"],
        thread_pair_matmul_flops=_CPU_MEASURED["thread_pair_matmul_flops"],
        collective_speed=_CPU_MEASURED["collective_speed"],
        batched_matmul_efficiency=_CPU_MEASURED["batched_matmul_efficiency"],
        elementwise_speedups=_CPU_ELEMENTWISE,
        sources={
            "peak_flops": f"{_CALIBRATED}: float32 forward products of the zoo's Dense layers "
            "([2048,128]x[128,512], [2048,512]x[512,128], [256,1024]x[1024,1024]), all cores "
            f"({_CPU_MEASURED['measured']}, {_CPU_MEASURED['machine']['cpu']}); the same "
            "rate with AMP (TensorFlow's CPU matmuls in 16 bits are no faster)",
            "peak_flops_fp32": "the same measured float32 rate",
            "memory": f"{_CALIBRATED}: elementwise add of 2**22 float32; 16 GB assumed size",
            "matmul_efficiency": "1: the peak is itself a measured matmul rate",
            "sm_count": "0: no wave quantization (the cores run a matmul's blocks in turn)",
            "memory_efficiency": "1: the bandwidth is itself a measured elementwise rate",
            "intra_node_efficiency": "1: the bandwidth is itself a measured all-reduce rate",
            "intra_node_bandwidth": f"{_CALIBRATED}: all-reduce of 16 kB and 16 MB between 2 "
            "logical devices (slope)",
            "latency_s": f"{_CALIBRATED}: the same all-reduces (intercept, over its 2 ring steps)",
            "collective_speed": f"{_CALIBRATED}: reduce-scatters and all-gathers of the same "
            "sizes: {reduce_scatter:.2f}x and {all_gather:.2f}x the all-reduce's bytes per "
            "second".format(**_CPU_MEASURED["collective_speed"]),
            "layer_overhead_s": f"{_CALIBRATED}: EPLTrainer steps of Dense(8) stacks of 4 and "
            "36 layers (slope per layer), on 1 device, each step timed on its own (not the "
            "fit call's copies of every weight)",
            "step_overhead_s": f"{_CALIBRATED}: the same steps (intercept)",
            "pool_overhead": f"{_CALIBRATED}: the same, data-parallel on 1, 2 and 4 logical "
            "devices: "
            + " / ".join(f"{layer * 1e6:.0f}" for _, layer, _ in _CPU_MEASURED["pool_overhead"])
            + " us per layer, "
            + " / ".join(f"{step * 1e3:.2f}" for _, _, step in _CPU_MEASURED["pool_overhead"])
            + " ms per step",
            "host_bandwidth": "the host is the same memory: a copy at memory_bandwidth",
            "shares_compute": "logical CPU devices share the process's cores and memory "
            "(docs/architecture.md)",
            "pool_matmul_flops": f"{_CALIBRATED}: the Dense layers' products on 1, 2 and 4 "
            "logical devices side by side, one thread per op from 2 on: "
            + " / ".join(f"{f / 1e9:.0f}" for _, f in _CPU_MEASURED["pool_matmul_flops"])
            + " GFLOP/s together",
            "pool_memory_bandwidth": f"{_CALIBRATED}: the adds on 1, 2 and 4 logical devices "
            "side by side: "
            + " / ".join(f"{b / 1e9:.1f}" for _, b in _CPU_MEASURED["pool_memory_bandwidth"])
            + " GB/s together",
            "batched_matmul_efficiency": f"{_CALIBRATED}: attention's per-head products as "
            "Keras's MultiHeadAttention runs them (its two einsums and their gradients; 32 "
            "samples, 64 positions, 4 heads of 32) over the matmuls on the same devices: "
            + " / ".join(f"{v:.2f}" for _, v in _CPU_MEASURED["pool_batched_matmul_efficiency"])
            + " on 1, 2 and 4 devices, their median",
            "elementwise_speedups": f"{_CALIBRATED}: a LayerNormalization's forward and "
            "backward on a [32, 64, 128] float32 activation on 1, 2 and 4 devices side by "
            "side (bytes counted from its traced ops): "
            + " / ".join(f"{b / 1e9:.1f}" for _, b in _CPU_MEASURED["pool_layer_norm_bandwidth"])
            + " GB/s, over the adds' (pool_memory_bandwidth): "
            + " / ".join(f"{v:.2f}" for _, v in _CPU_ELEMENTWISE)
            + " (a layer's ops read what the op before wrote, from the caches)",
            "thread_matmul_flops": f"{_CALIBRATED}: the Dense layers' products on one device "
            f"with one thread per op: {_CPU_MEASURED['thread_matmul_flops'] / 1e9:.1f} GFLOP/s",
            "thread_pair_matmul_flops": f"{_CALIBRATED}: a backward's input and weight "
            "gradients (independent products) of the zoo's Dense layers ([2048,128]x[128,512], "
            "[2048,512]x[512,128], [256,1024]x[1024,1024]) on one device with one thread per "
            "op, the others idle: "
            f"{_CPU_MEASURED['thread_pair_matmul_flops'] / 1e9:.1f} GFLOP/s (the runtime's "
            "inter-op threads run the two side by side)",
            "thread_memory_bandwidth": f"{_CALIBRATED}: the adds on one device with one thread "
            f"per op: {_CPU_MEASURED['thread_memory_bandwidth'] / 1e9:.1f} GB/s",
        },
    )
)


def device_by_name(name: str) -> DeviceSpec:
    """The table's entry for `name` (case-insensitive)."""
    key = str(name).lower()
    if key not in DEVICES:
        raise ValueError(f"Unknown device {name!r}. Known devices: {sorted(DEVICES)}")
    return DEVICES[key]


def custom_device(
    base: DeviceSpec | None = None,
    *,
    peak_tflops: float | None = None,
    memory_bytes: float | None = None,
) -> DeviceSpec:
    """`base` with its 16-bit peak and / or memory replaced (`--peak_tflops`,
    `--device_memory`); without a base, an A100-80GB's links and efficiency with the given
    peak (float32 at half of it) and memory."""
    spec = base or DEVICES["a100-80gb"]
    changes, sources = {}, dict(spec.sources)
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0. Received: peak_tflops={peak_tflops!r}")
        ratio = spec.peak_flops_fp32 / spec.peak_flops if base else 0.5
        changes.update(peak_flops=peak_tflops * 1e12, peak_flops_fp32=peak_tflops * 1e12 * ratio)
        sources["peak_flops"] = f"--peak_tflops {peak_tflops:g}"
    if memory_bytes is not None:
        changes["memory_bytes"] = memory_bytes
        sources["memory"] = f"--device_memory {memory_bytes:.4g} bytes"
    name = spec.name if base else "custom"
    if changes and base:
        name = f"{spec.name} (custom)"
    return dataclasses.replace(spec, name=name, sources=sources, **changes)


def sources_table() -> list[tuple[str, str, str, str]]:
    """(device, constant, value, source) rows: the one table of the model's constants."""
    rows = []
    for spec in DEVICES.values():
        values = {
            "peak_flops": f"{spec.peak_flops / 1e12:.4g} TFLOP/s",
            "peak_flops_fp32": f"{spec.peak_flops_fp32 / 1e12:.4g} TFLOP/s",
            "memory": f"{spec.memory_bytes / GB:.4g} GB, {spec.memory_bandwidth / GB:.4g} GB/s",
            "memory_efficiency": f"{spec.memory_efficiency:.2f} "
            f"({spec.streaming_bandwidth / GB:.4g} GB/s)",
            "matmul_efficiency": f"{spec.matmul_efficiency:.3f}",
            "batched_matmul_efficiency": f"{spec.batched_matmul_efficiency:.3f}",
            "sm_count": f"{spec.sm_count}",
            "matmul_tiles": " ".join(f"{r}x{c}" for r, c in spec.matmul_tiles),
            "intra_node_bandwidth": f"{spec.intra_node_bandwidth / GB:.4g} GB/s",
            "intra_node_efficiency": f"{spec.intra_node_efficiency:.2f} "
            f"({spec.nvlink_bandwidth / GB:.4g} GB/s)",
            "inter_node_bandwidth": f"{spec.inter_node_bandwidth / GB:.4g} GB/s per node",
            "latency_s": f"{spec.latency_s * 1e6:.3g} us",
            "host_bandwidth": f"{spec.host_bandwidth / GB:.4g} GB/s",
            "host_memory_bandwidth": f"{spec.host_memory_bandwidth / GB:.4g} GB/s",
            "layer_overhead_s": f"{spec.layer_overhead_s * 1e6:.3g} us",
            "step_overhead_s": f"{spec.step_overhead_s * 1e3:.3g} ms",
            "shares_compute": f"{spec.shares_compute} ({spec.cores} cores)",
            "elementwise_speedups": " / ".join(f"{f:.2f}" for _, f in spec.elementwise_speedups),
        }
        # The table's order (a constant, then what refines it), then any other source.
        order = list(values) + [key for key in spec.sources if key not in values]
        for key in sorted(spec.sources, key=order.index):
            rows.append((spec.name, key, values.get(key, ""), spec.sources[key]))
    return rows
