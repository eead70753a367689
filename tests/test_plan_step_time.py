"""epl-plan's step-time model (core/plan/step_time.py) and device table (core/plan/devices.py):
each term against its formula, by arithmetic (no TensorFlow)."""

import dataclasses
import json

import pytest

from epl_trainer.config.sections import Config
from epl_trainer.core.plan import analytic, devices, rules, step_time
from epl_trainer.core.plan.schedule import bubble_fraction
from epl_trainer.core.plan.step_time import Layout, predict
from epl_trainer.runtime import plan_cli

A100 = devices.device_by_name("a100-80gb")
CPU = devices.device_by_name("cpu")


def _transformer(layers=8, hidden=256, heads=4, seq_len=128, vocab=1000):
    return analytic.transformer(layers, hidden, heads, vocab, seq_len, name="t")


# ------------------------------------------------------------------ the device table
def test_every_device_states_the_source_of_every_constant():
    needed = {
        "peak_flops", "peak_flops_fp32", "memory", "matmul_efficiency",
        "intra_node_bandwidth", "latency_s", "layer_overhead_s",
    }  # fmt: skip
    for name, spec in devices.DEVICES.items():
        missing = needed - set(spec.sources)
        assert not missing, f"{name} has no source for {missing}"
        assert all(source.strip() for source in spec.sources.values())
    assert {"a100-80gb", "a100-40gb", "h100", "v100", "cpu"} <= set(devices.DEVICES)
    # Datasheet peaks (dense 16-bit), memories and the measured CPU rate.
    assert A100.peak_flops == 312e12 and A100.memory_bytes == 80e9
    assert devices.DEVICES["h100"].peak_flops == 989e12
    assert devices.DEVICES["v100"].peak_flops == 125e12
    assert devices.DEVICES["a100-40gb"].memory_bytes == 40e9
    assert CPU.shares_compute and CPU.peak_flops > 1e10
    rows = devices.sources_table()
    assert rows[0][:3] == ("a100-80gb", "peak_flops", "312 TFLOP/s")


def test_custom_devices_and_unknown_names():
    custom = devices.custom_device(peak_tflops=100, memory_bytes=16e9)
    assert (custom.name, custom.peak_flops, custom.memory_bytes) == ("custom", 100e12, 16e9)
    assert custom.sources["peak_flops"] == "--peak_tflops 100"
    faster = devices.custom_device(A100, peak_tflops=624)
    assert faster.peak_flops_fp32 == 2 * A100.peak_flops_fp32  # the same fp32 : 16-bit ratio
    with pytest.raises(ValueError, match=r"Unknown device 'b200'\. Known devices: \['a100"):
        devices.device_by_name("b200")
    with pytest.raises(ValueError, match="peak_tflops must be > 0"):
        devices.custom_device(peak_tflops=0)


def test_pool_overheads_interpolate_the_measured_points():
    points = CPU.pool_overhead
    for count, layer, step in points:
        assert CPU.pool_overheads(count) == pytest.approx((layer, step))
    (n0, l0, _), (n1, l1, _) = points[-2:]
    assert CPU.pool_overheads(8)[0] == pytest.approx(l1 + (8 - n1) * (l1 - l0) / (n1 - n0))


# ------------------------------------------------------------------ terms
def test_one_device_step_is_compute_elementwise_overhead_and_update():
    model = _transformer()
    layout = Layout(micro_batch_size=4, num_micro_batch=2, amp="O1")
    result = predict(model, layout, A100)
    terms = result.terms
    rate = A100.matmul_efficiency * A100.peak_flops
    assert terms["compute"] == pytest.approx(3 * model.flops * 4 * 2 / rate)
    assert terms["recompute"] == terms["tensor_comm"] == terms["bubble"] == 0
    assert terms["data_comm"] == terms["pipeline_comm"] == 0
    # Adam reads p, g, m, v and writes p, m, v: 28 bytes per float32 parameter.
    assert terms["optimizer"] == pytest.approx(28 * model.params / A100.memory_bandwidth)
    assert result.step_time_s == pytest.approx(sum(terms.values()))
    assert result.model_flops == 3 * model.flops * 8
    assert result.tflops_per_device == pytest.approx(result.model_flops / result.step_time_s / 1e12)
    assert result.mfu == pytest.approx(result.tflops_per_device * 1e12 / 312e12)
    # float32 runs at the TF32 rate, MFU against it.
    fp32 = predict(model, dataclasses.replace(layout, amp=""), A100)
    assert fp32.terms["compute"] == pytest.approx(terms["compute"] * 2)
    assert fp32.peak_flops == A100.peak_flops_fp32


def test_checkpointing_recomputes_one_forward():
    model = _transformer()
    plain = predict(model, Layout(micro_batch_size=8), A100).terms
    gc = predict(model, Layout(micro_batch_size=8, gc=True), A100)
    assert gc.terms["recompute"] == pytest.approx((plain["compute"] + plain["elementwise"]) / 3)
    assert gc.hardware_flops == pytest.approx(4 / 3 * gc.model_flops)
    assert gc.peak_memory_bytes < predict(model, Layout(micro_batch_size=8), A100).peak_memory_bytes


@pytest.mark.parametrize(
    "schedule, virtual", [("PreferBackward", 1), ("PreferForward", 1), ("ZeroBubbleH1", 1),
                          ("Interleaved1F1B", 2)]
)  # fmt: skip
def test_the_bubble_is_the_schedules_idle_share(schedule, virtual):
    model = _transformer(layers=16)
    layout = Layout(pipeline_parallel=4, virtual_stages=virtual, num_micro_batch=8,
                    micro_batch_size=2, schedule=schedule)  # fmt: skip
    result = predict(model, layout, A100)
    busy = sum(v for k, v in result.terms.items()
               if k in ("compute", "elementwise", "recompute", "tensor_comm", "pipeline_comm",
                        "overhead"))  # fmt: skip
    idle = bubble_fraction(4 * virtual, 8, schedule, virtual)
    assert result.terms["bubble"] == pytest.approx(busy * idle / (1 - idle))
    assert result.terms["pipeline_comm"] > 0


def test_tensor_parallelism_splits_layers_and_adds_all_reduces():
    model = _transformer(layers=4, hidden=1024, heads=16, seq_len=512)
    one = predict(model, Layout(micro_batch_size=4, amp="O1"), A100)
    two = predict(model, Layout(tensor_parallel=2, micro_batch_size=4, amp="O1"), A100)
    # Every node of this model is split: half the FLOPs per rank.
    assert two.terms["compute"] == pytest.approx(one.terms["compute"] / 2)
    assert two.model_flops == one.model_flops and two.layout.devices == 2
    # 2 all-reduces forward, 2 backward per layer, 1 in the embedding and 1 in the head, of
    # the residual stream (16-bit), each sending 2(t-1)/t of it over NVLink.
    stream = 4 * 512 * 1024 * 2
    per = 2 * (2 - 1) / 2 * stream / A100.intra_node_bandwidth + 2 * A100.latency_s
    assert two.terms["tensor_comm"] == pytest.approx((4 * 4 + 2) * per)
    assert two.peak_memory_bytes < one.peak_memory_bytes
    with pytest.raises(ValueError, match=r"no node tensor parallelism splits .* tensor_parallel=2"):
        predict(analytic.params_only(1e9), Layout(tensor_parallel=2), A100)


def test_data_parallel_all_reduce_within_and_across_nodes():
    model = analytic.params_only(1e9)
    layout = Layout(data_parallel=8, overlap_grad_reduce=False)
    within = predict(model, layout, A100).terms["data_comm"]
    sent = 2 * 7 / 8 * 4e9
    assert within == pytest.approx(sent / 300e9 + 1 * 2 * 7 * 5e-6)
    # 16 devices over 2 nodes: the ring crosses the nodes' 200 GB/s adapters.
    across = predict(model, dataclasses.replace(layout, data_parallel=16), A100).terms
    assert across["data_comm"] == pytest.approx(2 * 15 / 16 * 4e9 / 200e9 + 2 * 15 * 5e-6)
    # Megatron's order puts a 8-way tensor group in each node: the data group has one member
    # per node and shares the adapters with 7 others.
    spread = Layout(data_parallel=2, tensor_parallel=8, overlap_grad_reduce=False,
                    rank_order="tp,dp,pp")  # fmt: skip
    assert step_time._group_bandwidth(A100, 2, step_time._stride(spread, "dp")) == 25e9
    # The engine overlaps the reduction with the last backward: never more exposed.
    overlapped = predict(_transformer(), Layout(data_parallel=8, micro_batch_size=8), A100)
    exposed = predict(_transformer(), Layout(data_parallel=8, micro_batch_size=8,
                                             overlap_grad_reduce=False), A100)  # fmt: skip
    assert overlapped.terms["data_comm"] < exposed.terms["data_comm"]


@pytest.mark.parametrize("zero", ["", "v0", "v1", "v2"])
@pytest.mark.parametrize("gc", [False, True])
def test_data_parallel_collectives_by_kind_add_up_to_the_estimates_traffic(zero, gc):
    layout = Layout(data_parallel=4, num_micro_batch=3, micro_batch_size=2, zero=zero, gc=gc)
    result = step_time.estimate_layout(_transformer(), layout)
    for stage in result.stages:
        sent = sum(b for _, b, _ in step_time._data_collectives(stage, layout))
        assert sent == pytest.approx(stage.comm_data_parallel, rel=1e-6)


def test_zero_divides_the_update_and_offload_moves_it_to_the_host():
    model = _transformer()
    plain = predict(model, Layout(data_parallel=8, micro_batch_size=2), A100)
    zero = predict(model, Layout(data_parallel=8, micro_batch_size=2, zero="v1"), A100)
    assert zero.terms["optimizer"] == pytest.approx(plain.terms["optimizer"] / 8)
    assert zero.peak_memory_bytes < plain.peak_memory_bytes
    off = predict(model, Layout(micro_batch_size=2, offload=True), A100)
    on_device = predict(model, Layout(micro_batch_size=2), A100)
    # The weights up for each of the 1 micro-batch(es), the gradients down.
    assert off.terms["offload"] == pytest.approx(2 * model.params * 4 / A100.host_bandwidth)
    assert off.terms["optimizer"] > on_device.terms["optimizer"]  # host memory is slower
    assert off.peak_memory_bytes < on_device.peak_memory_bytes


def test_logical_cpu_devices_share_the_cores():
    """Data parallelism on logical CPU devices does not divide the compute: the pool of
    cores runs every replica's work."""
    model = _transformer(layers=2, hidden=128, seq_len=64)
    one = predict(model, Layout(micro_batch_size=16), CPU)
    two = predict(model, Layout(data_parallel=2, micro_batch_size=8), CPU)
    assert two.step_time_s >= one.step_time_s
    # On separate GPUs the same split halves the compute.
    assert predict(model, Layout(data_parallel=2, micro_batch_size=8), A100).terms[
        "compute"
    ] == pytest.approx(predict(model, Layout(micro_batch_size=16), A100).terms["compute"] / 2)


def test_layouts_are_checked_and_their_config_runs_in_the_trainer():
    with pytest.raises(ValueError, match=r"data_parallel must be an int >= 1\. Received"):
        Layout(data_parallel=0)
    with pytest.raises(ValueError, match="Interleaved1F1B runs virtual_stages >= 2"):
        Layout(pipeline_parallel=2, schedule="Interleaved1F1B")
    layout = Layout(pipeline_parallel=2, virtual_stages=2, schedule="Interleaved1F1B",
                    num_micro_batch=4, zero="v1", gc=True, amp="O1")  # fmt: skip
    keys = layout.config()
    assert keys["pipeline.num_stages"] == 4 and keys["auto.auto_parallel"] is True
    config = Config(keys)  # the trainer's parser accepts every key
    rules.check_config(config)
    assert config.pipeline.virtual_stages == 2 and config.zero.level == "v1"
    assert Layout().config() == {"pipeline.num_micro_batch": 1}  # defaults left out


def test_in_flight_closed_forms_are_the_built_schedules_counts():
    from epl_trainer.core.plan import estimate
    from epl_trainer.core.plan.schedule import make_schedule, peak_in_flight

    for strategy in ("PreferForward", "PreferBackward", "ZeroBubbleH1"):
        for stages in (1, 2, 3, 5, 8):
            for micro_batches in (1, 2, 3, 7, 8, 16):
                built = peak_in_flight(make_schedule(strategy, stages, micro_batches, 1))
                assert list(estimate._in_flight(strategy, stages, micro_batches, 1)) == built


# ------------------------------------------------------------------ the CLI
def test_cli_prints_and_returns_step_time_throughput_mfu_and_memory(capsys):
    args = ["--model", "transformer", "--layers", "8", "--hidden", "512", "--heads", "8"]
    args += ["--vocab", "1000", "--seq_len", "256", "--num_workers", "2", "--gpu_per_worker", "8"]
    args += ["--tensor_parallel", "2", "--num_stages", "2", "--num_micro_batch", "4", "--amp"]
    assert plan_cli.main([*args, "--device", "a100-80gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tflops_per_device", "mfu", "peak_memory_bytes"):
        assert data[key] > 0, key
    assert data["devices"] == 16 and data["data_parallel"] == 4
    assert data["mfu"] == pytest.approx(data["tflops_per_device"] * 1e12 / 312e12)
    assert plan_cli.main([*args, "--device", "a100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "Step time on 16 x a100-80gb (peak 312 TFLOP/s" in text and "MFU" in text
    # --peak_tflops alone: a custom device with one worker's peak over its 8 devices.
    assert plan_cli.main([*args, "--peak_tflops", "800", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "custom"
    with pytest.raises(SystemExit):
        plan_cli.main([*args[:-1], "--tensor_parallel", "3"])
    assert "tensor_parallel must be an int >= 1 dividing gpu_per_worker" in capsys.readouterr().err


# ------------------------------------------------------------------ against measurement
@pytest.mark.slow
def test_predicted_peak_of_measured_runs():
    """Two configurations of bench/plan_accuracy.py (one device; 2-way data parallelism
    with ZeRO v1), each in a fresh process: the process's peak within 10% of the
    prediction. Step times are printed, not asserted (they vary with the machine's load;
    docs/benchmarks.md has the bench's table)."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
    sys.path.insert(0, bench)
    from _fresh_process import run_child

    script = os.path.join(bench, "plan_accuracy.py")
    chosen = [1, 25]
    measured = [run_child(script, [*plan_accuracy_config(i), 3], timeout=600) for i in chosen]
    predicted = run_child(script, ["predict", chosen], timeout=600)
    for index, row, prediction in zip(chosen, measured, predicted):
        error = prediction["predicted_peak"] / row["measured_peak"] - 1
        print(
            f"\n{index}: {row['layout']}: peak {row['measured_peak'] / 1e6:.1f} MB measured, "
            f"{prediction['predicted_peak'] / 1e6:.1f} predicted ({error:+.1%}); step "
            f"{row['measured_step_s'] * 1e3:.1f} ms measured, "
            f"{prediction['predicted_step_s'] * 1e3:.1f} predicted"
        )
        assert abs(error) <= 0.10


def plan_accuracy_config(index):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
    import plan_accuracy

    return plan_accuracy.CONFIGS[index - 1]
