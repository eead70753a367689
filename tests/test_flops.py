"""FLOPs counted from traced training steps (core/graph/flops.py) against hand counts, the
machine's matmul peak (core/graph/peak.py) and the MFU bound.

Hand counts, a multiply-add = 2 FLOPs: a Dense x[b, i] @ W[i, o] is 2*b*i*o forward; its
backward is the same again for dX (skipped when x is an input of the model: TensorFlow
prunes that gradient) and for dW. So a step's backward is 2x its forward, minus the forward
of the contractions whose other operand gets no gradient (the model's first layer; the MoE
dispatch einsum, whose 0/1 dispatch mask is not differentiable).
"""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_bert_squad_model import SMALL as SMALL_BERT

import epl_trainer as epl
from epl_trainer.core.graph import cost, peak
from epl_trainer.core.graph.flops import count_flops
from epl_trainer.core.graph.flops_profile import format_profile, train_step_flops
from model_zoo.bert_squad.modeling import BertConfig, build_squad_model
from model_zoo.moe_t5 import data as moe_data
from model_zoo.moe_t5 import model as moe_t5
from model_zoo.resnet50 import model as resnet

SPARSE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def within(counted: int, hand: int, tolerance=0.02) -> bool:
    return abs(counted - hand) <= tolerance * hand


# ---------------------------------------------------------------- a Dense stack, exactly
def dense_stack():
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="stack")
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("earlier_adams", [0, 2], ids=["first_adam", "third_adam"])
def test_a_dense_stack_counted_exactly_by_hand(earlier_adams):
    for _ in range(earlier_adams):  # Keras names later optimizers adam_1, adam_2, ...
        dense_stack()
    count = train_step_flops(dense_stack(), tf.TensorSpec((5, 4)), tf.TensorSpec((5, 3)))

    hidden, out = 2 * 5 * 4 * 8, 2 * 5 * 8 * 3  # 320, 240
    assert count.by_phase() == {
        "forward": hidden + out,
        # out: dX and dW; hidden: dW only (its input is the model's input)
        "backward": 2 * out + hidden,
        "optimizer": 0,  # Adam is elementwise
    }
    assert count.flops == 1360
    assert count.by_layer() == {"hidden": 2 * hidden, "out": 3 * out}
    assert count.by_op_type() == {"MatMul": 1360}
    assert count.by_stage({"hid.*": 0, "out": 1}) == {0: 640, 1: 720}
    # Elementwise, 1 per output element: the hidden layer's BiasAdd and Relu (5 x 8 each).
    hidden_elementwise = [op for op in count.ops if not op.contraction and op.layer == ("hidden",)]
    forward = {op.op_type: op.flops for op in hidden_elementwise if op.phase == "forward"}
    assert forward == {"BiasAdd": 40, "Relu": 40}
    # Adam's update: a dozen elementwise ops over each of the 67 parameters.
    assert count.by_phase(contraction=False)["optimizer"] > 10 * 67


def test_the_profile_table_shows_layers_stages_and_op_types():
    count = train_step_flops(dense_stack(), tf.TensorSpec((5, 4)), tf.TensorSpec((5, 3)))
    text = format_profile(
        count, stage_of={"hidden": 0, "out": 1}, summary=[("step time", "1.00 ms")]
    )
    lines = text.splitlines()
    assert any(line.split()[-1] == "1.36k" for line in lines if "FLOPs per step" in line)
    assert any(line.split() == ["step", "time", "1.00", "ms"] for line in lines)
    assert any(line.split() == ["MatMul", "1.36k", "100.0%"] for line in lines)
    assert any(line.split() == ["hidden", "320", "320", "0", "47.1%"] for line in lines)
    assert any(line.split() == ["1", "720", "52.9%"] for line in lines)  # stage 1
    assert "depth 1: out 720" in text
    assert "FLOPs per layer" not in format_profile(count, detailed=False)


def test_a_loss_without_compile_and_an_uncompiled_model_refused():
    model = dense_stack()
    count = train_step_flops(
        model,
        np.zeros((5, 4), "float32"),
        np.zeros((5, 3), "float32"),
        loss=lambda y, p, w: keras.ops.mean((y - p) ** 2),
        optimizer=keras.optimizers.SGD(),
    )
    assert count.flops == 1360
    bare = keras.Model(model.inputs, model.outputs)
    with pytest.raises(ValueError, match="needs a loss: pass loss= or compile"):
        train_step_flops(bare, tf.TensorSpec((5, 4)), tf.TensorSpec((5, 3)))


# ---------------------------------------------------------------- the zoo's models
def test_bert_squad_forward_and_backward_within_2_percent_of_hand_count():
    config = SMALL_BERT
    batch, seq, h, i, layers = 4, 16, 8, 16, 2
    model = build_squad_model(config, seq)
    model.compile(optimizer="adam", loss={"start_logits": SPARSE, "end_logits": SPARSE})
    features = {k: tf.TensorSpec((batch, seq), tf.int32) for k in model.input}
    labels = {k: tf.TensorSpec((batch,), tf.int32) for k in ("start_logits", "end_logits")}

    count = train_step_flops(model, features, labels)

    tokens = batch * seq
    per_layer = (
        4 * 2 * tokens * h * h  # query, key, value, attention output
        + 2 * 2 * tokens * seq * h  # scores and context, over all heads
        + 2 * 2 * tokens * h * i  # intermediate and output
    )
    forward = layers * per_layer + 2 * tokens * h * 2  # + the span head
    phases = count.by_phase()
    assert within(phases["forward"], forward)
    # Every contraction's inputs get gradients (the embeddings are trained).
    assert within(phases["backward"], 2 * forward)
    assert within(count.by_layer(1)["layer_1"], 3 * per_layer)
    assert within(count.by_layer(2)["layer_0/intermediate"], 3 * 2 * tokens * h * i)
    assert count.unknown_loops == () and count.unresolved == ()


def test_resnet50_small_within_2_percent_of_hand_count():
    batch = 2
    model = resnet.build_model(10, small=True)
    model.compile(optimizer="sgd", loss=SPARSE)

    count = train_step_flops(
        model, tf.TensorSpec((batch, 32, 32, 3)), tf.TensorSpec((batch,), tf.int32)
    )

    convolutions = {}
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            kh, kw, cin, cout = layer.kernel.shape
            _, height, width, _ = layer.output.shape
            convolutions[layer.name] = 2 * batch * height * width * cout * kh * kw * cin
    head = 2 * batch * 256 * 10
    forward = sum(convolutions.values()) + head
    phases = count.by_phase()
    assert len(convolutions) == 13
    assert within(phases["forward"], forward)
    # conv1's input is the image: its input gradient is pruned, its filter gradient is not.
    assert within(phases["backward"], 2 * forward - convolutions["conv1_conv"])
    assert set(count.by_op_type()) == {
        "Conv2D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "MatMul",
    }
    # The static cost model's hand formulas (per sample, forward) agree.
    static = sum(c.flops for c in cost.node_costs(model) if c.kind in ("Conv2D", "Dense"))
    assert within(phases["forward"], batch * static)


def test_moe_t5_within_2_percent_of_hand_count():
    length, batch = 6, 4
    epl.init(epl.Config())
    config = moe_t5.T5Config(
        vocab_size=len(moe_data.task_vocabulary()),
        d_model=16,
        num_heads=2,
        num_layers=1,
        expert_hidden=16,
        dropout=0.0,
        max_source_length=length,
        max_target_length=length,
    )  # test_moe_t5.tiny_config
    model = moe_t5.build_model(config)
    model.compile(optimizer="adam", loss=moe_t5.SequenceCrossEntropy())
    features = {k: tf.TensorSpec((batch, length), tf.int32) for k in model.input}

    count = train_step_flops(model, features, tf.TensorSpec((batch, length), tf.int32))

    d, e, hidden, v = config.d_model, config.num_experts, config.expert_hidden, config.vocab_size
    tokens = batch * length
    attention = 4 * 2 * tokens * d * d + 2 * 2 * tokens * length * d  # projections, scores, A.V
    capacity = max(4, math.ceil(tokens * config.top_k * config.capacity_factor / e))
    dispatch = 2 * tokens * e * capacity * d  # [G,S,E,C] x [G,S,d], and the combine likewise
    moe = 2 * tokens * d * e + 2 * dispatch + 2 * (2 * e * capacity * d * hidden)
    forward = 3 * attention + 2 * moe + 2 * tokens * d * v  # enc self, dec self + cross
    phases = count.by_phase()
    assert within(phases["forward"], forward)
    # The dispatch mask (one-hot of the router's argmax) gets no gradient: only the
    # tokens' side of the dispatch einsum runs backward.
    assert within(phases["backward"], 2 * forward - 2 * dispatch)
    assert within(count.by_layer(1)["encoder_0_moe"], 3 * moe - dispatch)
    assert count.by_op_type()["Einsum"] > 0


# ---------------------------------------------------------------- graph walking
def test_loops_calls_and_conditionals():
    a = tf.TensorSpec((4, 4))
    n = tf.TensorSpec((), tf.int32)
    matmul = 2 * 4 * 4 * 4

    @tf.function
    def inner(x):
        return tf.matmul(x, x)

    @tf.function
    def step(x, steps):
        x = inner(x)  # a function call: 1
        _, x = tf.while_loop(lambda i, x: i < 7, lambda i, x: (i + 1, tf.matmul(x, x)), (0, x))
        _, x = tf.while_loop(  # bounded by maximum_iterations: 3
            lambda i, x: i < steps,
            lambda i, x: (i + 1, tf.matmul(x, x)),
            (0, x),
            maximum_iterations=3,
        )
        _, y = tf.while_loop(  # no bound in the graph
            lambda i, x: i < steps, lambda i, x: (i + 1, tf.matmul(x, x)), (0, x)
        )
        # the larger branch (2 matmuls) counts
        z = tf.cond(steps > 2, lambda: tf.matmul(tf.matmul(x, x), x), lambda: x)
        tf.matmul(z, z)  # dead: pruned before the step runs
        return x + y + z

    function = step.get_concrete_function(a, n)
    count = count_flops(function)
    assert count.flops == (1 + 7 + 3 + 1 + 2) * matmul
    (unknown,) = count.unknown_loops
    assert unknown.startswith("while_2")
    assert count_flops(function, trip_counts={unknown: 5}).flops == (1 + 7 + 3 + 5 + 2) * matmul

    # Counting up by 2 from 1 while limit > i, the limit a loop variable the body passes
    # on: i = 1, 3, 5, 7, 9.
    @tf.function
    def by_two(x):
        return tf.while_loop(
            lambda i, limit, x: tf.greater(limit, i),
            lambda i, limit, x: (i + 2, limit, tf.matmul(x, x)),
            (1, 10, x),
        )[2]

    assert count_flops(by_two.get_concrete_function(a)).flops == 5 * matmul

    # Counting down is not read: the loop is listed, its body counted once.
    @tf.function
    def countdown(x):
        return tf.while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, tf.matmul(x, x)), (10, x))[1]

    count = count_flops(countdown.get_concrete_function(a))
    assert count.flops == matmul and len(count.unknown_loops) == 1


@pytest.mark.parametrize(
    "build, flops",
    [
        (lambda: tf.linalg.matmul(tf.zeros((2, 3, 5)), tf.zeros((2, 5, 7))), 2 * 2 * 3 * 5 * 7),
        (
            lambda: tf.linalg.matmul(
                tf.zeros((6, 3)), tf.zeros((7, 6)), transpose_a=True, transpose_b=True
            ),
            2 * 3 * 6 * 7,
        ),
        (
            lambda: tf.linalg.matmul(tf.zeros((4, 5, 3)), tf.zeros((1, 5, 7)), adjoint_a=True),
            2 * 4 * 3 * 5 * 7,  # broadcast batch
        ),
        (
            lambda: tf.einsum("...ij,jk->...ik", tf.zeros((2, 3, 4, 5)), tf.zeros((5, 6))),
            2 * 2 * 3 * 4 * 5 * 6,
        ),
        (lambda: tf.einsum("bij->bji", tf.zeros((2, 3, 4))), 0),
        (
            lambda: tf.nn.conv2d(tf.zeros((2, 9, 9, 3)), tf.zeros((3, 3, 3, 8)), 2, "VALID"),
            2 * 2 * 4 * 4 * 8 * 3 * 3 * 3,
        ),
        (
            lambda: tf.nn.depthwise_conv2d(
                tf.zeros((1, 8, 8, 4)), tf.zeros((3, 3, 4, 2)), [1, 1, 1, 1], "SAME"
            ),
            2 * 8 * 8 * 8 * 3 * 3,
        ),
    ],
    ids=[
        "batch_matmul",
        "matmul_transposed",
        "matmul_adjoint_broadcast",
        "einsum",
        "transpose",
        "conv",
        "depthwise",
    ],
)
def test_contraction_formulas(build, flops):
    function = tf.function(build).get_concrete_function()
    assert count_flops(function).flops == flops


def test_convolution_backprops_cost_their_forward():
    images, kernel = tf.zeros((2, 9, 9, 3)), tf.Variable(tf.zeros((3, 3, 3, 8)))
    depth_kernel = tf.Variable(tf.zeros((3, 3, 3, 2)))

    @tf.function
    def step(images):
        with tf.GradientTape() as tape:
            tape.watch(images)
            y = tf.nn.conv2d(images, kernel, 2, "VALID")
            z = tf.nn.depthwise_conv2d(images, depth_kernel, [1, 1, 1, 1], "SAME")
            loss = tf.reduce_sum(y) + tf.reduce_sum(z)
        # (Without the loss among the outputs the forward would be pruned: a sum's
        # gradient does not read its input.)
        return loss, tape.gradient(loss, [images, kernel, depth_kernel])

    count = count_flops(step.get_concrete_function(images))
    conv = 2 * 2 * 4 * 4 * 8 * 3 * 3 * 3
    depthwise = 2 * 2 * 9 * 9 * 6 * 3 * 3
    assert count.by_op_type() == {
        "Conv2D": conv,
        "Conv2DBackpropInput": conv,
        "Conv2DBackpropFilter": conv,
        "DepthwiseConv2dNative": depthwise,
        "DepthwiseConv2dNativeBackpropInput": depthwise,
        "DepthwiseConv2dNativeBackpropFilter": depthwise,
    }
    assert count.by_phase() == {
        "forward": conv + depthwise,
        "backward": 2 * (conv + depthwise),
        "optimizer": 0,
    }


def test_unknown_shapes_listed_not_counted():
    function = tf.function(tf.matmul).get_concrete_function(
        tf.TensorSpec((None, 4)), tf.TensorSpec((4, 3))
    )
    count = count_flops(function)
    assert count.flops == 0 and len(count.unresolved) == 1
    lines = format_profile(count).splitlines()
    assert any(line.split()[-1] == "1" for line in lines if "without static shapes" in line)


# ---------------------------------------------------------------- the peak and MFU
def test_peak_measured_once_per_machine_key_then_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak, "measure_in_fresh_process", lambda: calls.append(1) or 2e11)
    path = tmp_path / "peak.json"

    first = peak.matmul_peak(cache_file=path)
    second = peak.matmul_peak(cache_file=path)
    assert (first.source, second.source, len(calls)) == ("measured", "cached", 1)
    assert second.flops_per_second == 2e11
    (key,) = json.loads(path.read_text())
    assert set(json.loads(key)) == {"cpu", "cores", "tensorflow", "onednn"}
    assert json.loads(key)["tensorflow"] == tf.__version__

    # Another oneDNN setting (or CPU, core count, TF version) is another machine.
    real_key = peak.machine_key()
    monkeypatch.setattr(peak, "machine_key", lambda: {**real_key, "onednn": not real_key["onednn"]})
    assert peak.matmul_peak(cache_file=path).source == "measured"
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2

    configured = peak.matmul_peak(312.0, cache_file=path)  # an A100's bfloat16 peak
    assert (configured.source, configured.flops_per_second) == ("config", 312e12)
    assert len(calls) == 2


def test_peak_benchmark_runs_in_a_fresh_process():
    rate = peak.measure_in_fresh_process()
    # Any CPU TensorFlow runs on does more than 1 GFLOP/s and (2026) less than 100 TFLOP/s.
    assert 1e9 < rate < 1e14
    assert peak.measure_matmul_rate(size=128, repeats=2) > 1e8


def test_mfu_is_flops_over_time_over_peak_and_never_above_one():
    fake = peak.Peak(1e9, "config", "test machine")
    assert peak.model_flops_utilization(5e8, 1.0, fake) == pytest.approx(0.5)
    assert peak.model_flops_utilization(1e9, 1.0, fake, workers=2) == pytest.approx(0.5)
    with pytest.raises(peak.UtilizationError, match=r"MFU 150.0% is above 100%.*peak=0.001"):
        peak.model_flops_utilization(1.5e9, 1.0, fake)


# ---------------------------------------------------------------- TFLOP/s and MFU in the logs
def _drive(profiler, calls):
    """Runs the callback's hooks for calls of (rows, steps, seconds), as the trainer does."""
    stats, logs = profiler.stats, []
    profiler.on_train_begin()
    profiler.on_epoch_begin(0)
    for rows, steps, seconds in calls:
        stats.update(samples_per_sec=rows / seconds, call_steps=steps, call_seconds=seconds)
        profiler.on_train_batch_begin(0)
        logs.append({})
        profiler.on_train_batch_end(0, logs[-1])
    epoch = {}
    profiler.on_epoch_end(0, epoch)
    return logs, epoch


def test_mfu_is_the_counted_flops_over_the_measured_time_over_the_peak(tmp_path):
    from epl_trainer.training import monitors

    model = dense_stack()
    traced = []

    def count_step(rows):
        traced.append(rows)
        return train_step_flops(model, tf.TensorSpec((rows, 4)), tf.TensorSpec((rows, 3)))

    per_step = 1360 // 5 * 25  # the Dense stack's 272 FLOPs per row, 25 rows a step
    writer = monitors.CsvWriter(str(tmp_path), "mfu")
    profiler = monitors.FlopsProfiler(
        count_step, peak.Peak(1e5, "config", "fake"), stats={}, profile_step=-1, writers=[writer]
    )
    profiler.set_model(model)
    logs, epoch = _drive(profiler, [(50, 2, 2.0), (50, 2, 0.5), (50, 2, 0.25)])

    assert traced == [25]  # one trace per batch size
    # The first call (the trace) counts while it is the only one, then is left out.
    expected = [2 * per_step / 2.0, 2 * per_step / 0.5, 4 * per_step / 0.75]
    assert [entry["tflops"] * 1e12 for entry in logs] == pytest.approx(expected)
    assert [entry["mfu"] for entry in logs] == pytest.approx([r / 1e5 for r in expected])
    assert epoch == logs[-1]
    assert all(0 < entry["mfu"] <= 1 for entry in logs)
    rows = (tmp_path / "mfu" / "Train_Samples_mfu.csv").read_text().split()
    assert rows[0] == "step,mfu" and [r.split(",")[0] for r in rows[1:]] == ["50", "100", "150"]


def test_an_mfu_above_one_warns_with_every_term_and_is_not_logged():
    from epl_trainer.training import monitors

    model = dense_stack()
    count = train_step_flops(model, tf.TensorSpec((25, 4)), tf.TensorSpec((25, 3)))
    profiler = monitors.FlopsProfiler(
        lambda rows: count, peak.Peak(1e3, "cached", "fake"), stats={}, profile_step=-1
    )
    profiler.set_model(model)
    with pytest.warns(RuntimeWarning, match=r"MFU .* above 100%.*peak=1e-09 TFLOP/s \(cached"):
        logs, epoch = _drive(profiler, [(25, 1, 1.0), (25, 1, 1.0)])
    assert [sorted(entry) for entry in logs] == [["tflops"], ["tflops"]]
    assert "mfu" not in epoch


def _trainer(tmp_path, peak_tflops, steps_per_execution=1, **config):
    from _models import LOSS, mlp

    values = {
        "cluster.virtual_devices": 2,
        "profiler.flops": True,
        "profiler.peak_tflops": peak_tflops,
        "profiler.output_file": str(tmp_path / "profile.txt"),
        **config,
    }
    return epl.EPLTrainer(
        mlp(),
        LOSS,
        config=values,
        stages={"dense_in": 0, "logits": 1},
        steps_per_execution=steps_per_execution,
    )


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_the_trainer_logs_tflops_and_mfu_and_prints_the_profile(tmp_path, steps_per_execution):
    from _models import mlp_data

    x, y = mlp_data(n=128)
    trainer = _trainer(tmp_path, 0.001, steps_per_execution, **{"pipeline.num_micro_batch": 2})
    history = trainer.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)

    tflops, mfu = history.history["tflops"], history.history["mfu"]
    assert len(tflops) == len(mfu) == 2
    for achieved, utilization in zip(tflops, mfu):
        assert 0 < utilization <= 1
        assert utilization == pytest.approx(achieved / 0.001)
    # The mlp (6 -> 16 -> 3): 288 forward + 384 backward FLOPs a row, 32 rows a step.
    profile = (tmp_path / "profile.txt").read_text()
    assert "EPL FLOPs profile" in profile
    lines = profile.splitlines()
    total = next(line for line in lines if "FLOPs per step" in line)
    assert total.split()[-1] == "21.5k"  # 672 * 32
    assert any(line.split() == ["global", "batch", "(rows)", "32"] for line in lines)
    # The pipeline's stages: dense_in (2 * 192 * 32) and logits (3 * 96 * 32).
    assert any(line.split() == ["0", "12.3k", "57.1%"] for line in lines)
    assert any(line.split() == ["1", "9.22k", "42.9%"] for line in lines)
    assert trainer.step_stats["call_steps"] == steps_per_execution


def test_the_trainer_without_the_key_adds_no_profiler(tmp_path):
    from _models import mlp_data

    x, y = mlp_data(n=64)
    trainer = _trainer(tmp_path, 0.001, **{"profiler.flops": False})
    history = trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert "mfu" not in history.history and not (tmp_path / "profile.txt").exists()


def test_deepspeed_flops_profiler_writes_tflops_and_mfu_beside_the_monitors(tmp_path):
    from _models import LOSS, mlp, mlp_data

    from epl_trainer.deepspeed import DeepSpeedConfig

    values = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 2,
            "output_file": str(tmp_path / "profile.txt"),
        },
    }
    base = epl.Config({"cluster.virtual_devices": 2, "profiler.peak_tflops": 0.001})
    trainer = epl.EPLTrainer(mlp(), LOSS, config=DeepSpeedConfig(values, base=base))
    x, y = mlp_data(n=160)
    trainer.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0, shuffle=False)

    directory = tmp_path / "csv"
    rows = (directory / "Train_Samples_mfu.csv").read_text().split()
    assert rows[0] == "step,mfu"
    assert [r.split(",")[0] for r in rows[1:]] == ["32", "64", "96", "128"]
    assert all(0 < float(r.split(",")[1]) <= 1 for r in rows[1:])
    assert (directory / "Train_Samples_tflops.csv").exists()
    lines = (tmp_path / "profile.txt").read_text().splitlines()
    assert any(line.split() == ["profile", "step", "2"] for line in lines)
    assert any(line.split() == ["global", "batch", "(rows)", "32"] for line in lines)


def test_epl_plan_predicts_the_traced_flops_of_a_bert_step():
    """epl-plan's analytic transformer (no TensorFlow) against the traced zoo BERT at a
    width where its elementwise terms (softmax, norms: not in the traced count) are small."""
    from epl_trainer.runtime import plan_cli

    layers, hidden, heads, ffn, vocab, seq, batch = 2, 256, 4, 1024, 100, 32, 4
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=seq,
    )
    model = build_squad_model(config, seq)
    model.compile(optimizer="adam", loss={"start_logits": SPARSE, "end_logits": SPARSE})
    features = {k: tf.TensorSpec((batch, seq), tf.int32) for k in model.input}
    labels = {k: tf.TensorSpec((batch,), tf.int32) for k in ("start_logits", "end_logits")}
    traced = train_step_flops(model, features, labels).flops

    sizes = dict(layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab, seq_len=seq)
    args = [f"--{k}={v}" for k, v in sizes.items()]
    args = ["--model", "transformer", "--head", "span", "--micro_batch_size", str(batch), *args]
    parsed = plan_cli.build_parser().parse_args(args)
    options, request = plan_cli.options_from_args(parsed)
    analytic = plan_cli.model_from_args(parsed, None)
    result = plan_cli.plan_and_estimate(analytic, options, request, 1, 1)
    predicted, _ = plan_cli.step_flops(result)
    assert within(traced, predicted)
    assert traced != predicted  # two independent counts (the analytic one adds softmax etc.)
