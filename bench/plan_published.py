"""epl-plan's predictions against published runs: Megatron-LM's weak scaling and ZeRO-100B.

Usage: python bench/plan_published.py [--no_search] [--rows 1,10] [--ablations]

Pure arithmetic (no TensorFlow, about five and a half minutes with the searches). For each published
row: the model from its sizes (`analytic.transformer`, Megatron's fused elementwise
kernels), the layout the authors used (`step_time.Layout`), the device from the one
table of constants (`core/plan/devices.py`, printed first); the predicted throughput per
GPU in the paper's own FLOP convention next to the published one; which term would have
to change to meet it; and what `search.search` picks for the same GPUs and batch.

Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473, Table 1; the README's weak-scaling
table): GPT, sequence 2048, vocabulary 51,200, A100-80GB DGX nodes (8 GPUs, NVLink, 8 HDR
InfiniBand adapters), mixed precision with float32 master weights (`--fp16`), activation
recomputation of every layer (`--checkpoint-activations`). The paper counts
F = 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs per step (recomputation included). Its
ranks lay tensor groups innermost, then data-parallel, then pipeline stages. Each row's
layout is the one the authors ran: their scripts for the paper's figures and table
(Megatron-LM's examples/sc21/run_table_1.sh, commit de7dc40f88 of 2021-08-10, in the
nvcr.io pytorch:20.12 container) give each row's micro-batch size, its layers per
interleaved chunk (`--num-layers-per-virtual-pipeline-stage`; where none is given, plain
1F1B) and its data-parallel implementation: PyTorch's DDP (`--DDP-impl torch`, buckets
all-reduced during the backward) for the rows without a pipeline, Megatron's own
(`local`: one all-reduce after the backward) for the others. Pipeline sends use the
scatter / gather optimization (on by default there). The 1F1B prediction of an
interleaved row is in a column of its own.

The same code base a year later (Korthikanti et al. 2022, arXiv 2205.05198, "Reducing
Activation Recomputation in Large Transformer Models", section 6): the same authors'
Megatron-LM on the same machines (Selene: DGX A100 80GB, 8 HDR adapters per node), mixed
precision, without data parallelism. Table 3 gives each run's layout (three interleaved
chunks for 175B and 530B), Table 5 its iteration time with full activation
recomputation (the method of the 2021 runs), Table 4 the time of one layer of the 22B
model with and without it. Its software is a year newer; among what the paper names, its
backward overlaps the tensor-parallel all-reduce with the weight gradients' matmuls
(section 6.2), which this model does not (it would predict those runs faster still).

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054, section 10): a 100B-parameter GPT-2-like
model (125 layers, hidden 8192, 64 heads, sequence 1024, vocabulary 50,257) on 400 V100s
(25 DGX-2 nodes of 16, 800 Gb/s between nodes) with Megatron tensor parallelism 16 inside a
node, ZeRO P_os+g over the 25 replicas, checkpointed activations: 15 PFLOP/s, 38 TFLOP/s
per GPU. ZeRO-100B is ZeRO-DP's stages 1 and 2 plus all of ZeRO-R, whose P_a partitions
each checkpointed activation over the tensor group and all-gathers it before the
recomputed forward (`Layout.partition_activations`). The batch per replica is not in the
text we read: 32 (an assumption, printed).
"""

import argparse
import contextlib
import dataclasses
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from epl_trainer.core.plan import analytic, devices, search, step_time

TOLERANCE = 0.15
SEQUENCE, VOCAB = 2048, 51200
# (parameters B, heads, hidden, layers, tensor, pipeline, GPUs, batch, TFLOP/s per GPU,
#  then from run_table_1.sh: micro-batch size, layers per interleaved chunk (None: 1F1B),
#  data-parallel implementation)
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, "local"),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, "local"),
]
# Korthikanti et al. 2022, Tables 3 and 5: (model, heads, hidden, layers, tensor,
# pipeline, batch, micro-batch, interleaved chunks per device, iteration seconds with
# full recomputation).
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.42),
    ("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13),
    ("530B", 128, 20480, 105, 8, 35, 280, 1, 3, 49.05),
    ("1T", 160, 25600, 128, 8, 64, 512, 1, 1, 94.42),
]
# Table 4: forward + backward of one layer of the 22B model (ms), without and with
# recomputing it.
KORTHIKANTI_LAYER_MS = {False: 19.6, True: 27.2}
# Section 6.3: the 530B run on 8 replicas (2240 GPUs, the batch per replica kept) took
# 39.15 s where one replica took 37.83 (its own method, sequence parallelism and
# selective recomputation), "due to the gradient all-reduce", not overlapped.
KORTHIKANTI_REPLICAS = (8, 39.15 - 37.83)
ZERO_100B = {"layers": 125, "hidden": 8192, "heads": 64, "seq": 1024, "vocab": 50257,
             "tensor": 16, "replicas": 25, "replica_batch": 32, "tflops": 38}  # fmt: skip
# What the search may choose for these rows: our engine's ZeRO levels without v0/v2 (the
# published engines' choices are none and P_os+g), the published runs' micro-batch sizes
# and interleaved chunks per device.
SPACE = search.SearchSpace(
    micro_batch_sizes=(1, 2, 4, 8, 16), virtual_stages=(2, 3), zero=("", "v1")
)


def megatron_flops(batch, layers, hidden, seq=SEQUENCE, vocab=VOCAB):
    """The paper's FLOPs per step, activation recomputation included."""
    return (
        96
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    )


def row_case(row):
    params, heads, hidden, layers, t, p, gpus, batch, published, mbs, chunk, ddp = row
    model = analytic.transformer(
        layers, hidden, heads, VOCAB, SEQUENCE, activation="gelu_tanh", fused=True,
        name=f"GPT {params}B",
    )  # fmt: skip
    d = gpus // (t * p)
    layout = step_time.Layout(
        data_parallel=d, tensor_parallel=t, pipeline_parallel=p,
        num_micro_batch=batch // (d * mbs), micro_batch_size=mbs, amp="master", gc=True,
        overlap_grad_reduce=ddp == "torch", rank_order="tp,dp,pp",
    )  # fmt: skip
    if chunk:  # --num-layers-per-virtual-pipeline-stage: interleaved, layers / p / chunk
        v = layers // p // chunk
        layout = dataclasses.replace(layout, schedule="Interleaved1F1B", virtual_stages=v)
    flops = megatron_flops(batch, layers, hidden)
    return model, layout, devices.device_by_name("a100-80gb"), flops, published


def zero_case():
    z = ZERO_100B
    model = analytic.transformer(
        z["layers"], z["hidden"], z["heads"], z["vocab"], z["seq"], activation="gelu_tanh",
        fused=True, name="ZeRO-100B",
    )  # fmt: skip
    batch = z["replicas"] * z["replica_batch"]
    layout = step_time.Layout(
        data_parallel=z["replicas"], tensor_parallel=z["tensor"],
        num_micro_batch=z["replica_batch"], micro_batch_size=1, amp="master", gc=True,
        zero="v1", overlap_grad_reduce=False, rank_order="tp,dp,pp",
        partition_activations=True,
    )  # fmt: skip
    flops = megatron_flops(batch, z["layers"], z["hidden"], z["seq"], z["vocab"])
    return model, layout, devices.device_by_name("v100"), flops, z["tflops"]


def korthikanti_case(row):
    """(model, layout, device with 8 per node, the paper's FLOPs, published seconds) of
    a row of `KORTHIKANTI`."""
    name, heads, hidden, layers, t, p, batch, mbs, chunks, seconds = row
    model = analytic.transformer(
        layers, hidden, heads, VOCAB, SEQUENCE, activation="gelu_tanh", fused=True,
        name=f"GPT {name}",
    )  # fmt: skip
    layout = step_time.Layout(
        tensor_parallel=t, pipeline_parallel=p, num_micro_batch=batch // mbs,
        micro_batch_size=mbs, amp="master", gc=True, overlap_grad_reduce=False,
        rank_order="tp,dp,pp",
    )  # fmt: skip
    if chunks > 1:
        layout = dataclasses.replace(layout, schedule="Interleaved1F1B", virtual_stages=chunks)
    return model, layout, _selene_a100(), megatron_flops(batch, layers, hidden), seconds


def _selene_a100():
    """The A100 of the table in a DGX A100 node (8 per node), Selene's."""
    return dataclasses.replace(devices.device_by_name("a100-80gb"), devices_per_node=8)


def layer_seconds(row, gc):
    """Predicted forward + backward seconds of one transformer layer of a `KORTHIKANTI`
    row's model on its tensor group and micro-batch (Table 4's measurement): a step of
    two such layers less a step of one, the update left out (the table times the layer
    alone)."""
    _name, heads, hidden, _layers, t, _p, _batch, mbs, _chunks, _seconds = row
    device = _selene_a100()
    layout = step_time.Layout(tensor_parallel=t, micro_batch_size=mbs, amp="master", gc=gc,
                              rank_order="tp,dp,pp")  # fmt: skip

    def step_without_update(layers):
        model = analytic.transformer(layers, hidden, heads, VOCAB, SEQUENCE,
                                     activation="gelu_tanh", fused=True)  # fmt: skip
        prediction = step_time.predict(model, layout, device)
        return prediction.step_time_s - prediction.terms["optimizer"]

    return step_without_update(2) - step_without_update(1)


def korthikanti_tables():
    """The iteration table and the layer table of Korthikanti et al. 2022."""
    runs = [["model", "GPUs", "layout", "published s", "predicted s", "error",
             "published TFLOP/s", "predicted TFLOP/s"]]  # fmt: skip
    for row in KORTHIKANTI:
        model, layout, device, flops, seconds = korthikanti_case(row)
        predicted = step_time.predict(model, layout, device).step_time_s
        error = seconds / predicted - 1  # in throughput, as the tables above
        runs.append([
            model.name, str(layout.devices),
            f"tp {layout.tensor_parallel} pp {layout.pipeline_parallel} dp 1, mb "
            f"{layout.micro_batch_size} x {layout.num_micro_batch}"
            + (f" v {layout.virtual_stages}" if layout.virtual_stages > 1 else ""),
            f"{seconds:.2f}", f"{predicted:.2f}",
            f"{error:+.0%}" + ("" if abs(error) <= TOLERANCE else " !"),
            f"{flops / seconds / layout.devices / 1e12:.0f}",
            f"{flops / predicted / layout.devices / 1e12:.0f}",
        ])  # fmt: skip
    layers = [["one layer of GPT 22B (tp 8, mb 4), ms", "published", "predicted", "error"]]
    for gc, published_ms in KORTHIKANTI_LAYER_MS.items():
        predicted_ms = layer_seconds(KORTHIKANTI[0], gc) * 1e3
        layers.append([
            "with recompute" if gc else "no recompute", f"{published_ms:.1f}",
            f"{predicted_ms:.1f}", f"{published_ms / predicted_ms - 1:+.0%}",
        ])  # fmt: skip
    replicas, published_s = KORTHIKANTI_REPLICAS
    model, layout, device, _flops, _seconds = korthikanti_case(KORTHIKANTI[2])
    wider = dataclasses.replace(layout, data_parallel=replicas)
    added = (step_time.predict(model, wider, device).step_time_s
             - step_time.predict(model, layout, device).step_time_s)  # fmt: skip
    layers.append([f"GPT 530B on {replicas} replicas: time added per iteration (s)",
                   f"{published_s:.2f}", f"{added:.2f}",
                   f"{published_s / added:.1f}x the prediction"])  # fmt: skip
    return runs, layers


def implied_efficiency(prediction, device, flops, published):
    """The matmul efficiency that would make the matmul time alone meet the published
    time, the other terms as predicted: the table's, scaled by how much longer (or
    shorter) the matmuls would have to take (with their wave quantization and roofline)."""
    published_time = flops / (published * 1e12 * prediction.layout.devices)
    terms = prediction.terms
    # The recomputed forward's matmuls: the recompute term less its elementwise third.
    recomputed = terms["recompute"] - terms["elementwise"] / 3 if terms["recompute"] else 0.0
    compute = terms["compute"] + recomputed
    others = prediction.step_time_s - compute - terms["bubble"]
    # The bubble scales with the busy time it idles behind: keep its share.
    share = 1 + terms["bubble"] / max(prediction.step_time_s - terms["bubble"], 1e-12)
    needed = published_time / share - others
    return device.matmul_efficiency * compute / needed if needed > 0 else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no_search", action="store_true")
    parser.add_argument("--rows", help="comma-separated Megatron rows (1-based); 11 = ZeRO-100B")
    parser.add_argument(
        "--ablations", action="store_true",
        help="only each term's share of the miss: every row's error with one term taken out",
    )  # fmt: skip
    args = parser.parse_args()
    chosen = [int(i) for i in args.rows.split(",")] if args.rows else range(1, 12)
    if args.ablations:
        _print(ablations(chosen))
        return

    print("Constants (one table, the same for every row; core/plan/devices.py):")
    for name, key, value, source in devices.sources_table():
        if name in ("a100-80gb", "v100"):
            print(f"  {name:10} {key:22} {value:22} {source}")
    print()
    header = ["row", "model", "GPUs", "layout", "published", "predicted", "error", "1F1B",
              "largest terms", "implied matmul eff.", "peak GB"]  # fmt: skip
    table, searches = [header], []
    for index in chosen:
        model, layout, device, flops, published = _case(index)
        prediction = step_time.predict(model, layout, device)
        tflops = flops / prediction.step_time_s / layout.devices / 1e12
        error = tflops / published - 1
        plain = dataclasses.replace(layout, schedule="PreferBackward", virtual_stages=1)
        plain_tflops = flops / step_time.predict(model, plain, device).step_time_s
        plain_tflops /= layout.devices * 1e12
        terms = sorted(prediction.terms.items(), key=lambda kv: -kv[1])[:3]
        share = ", ".join(f"{k} {v / prediction.step_time_s:.0%}" for k, v in terms)
        efficiency = implied_efficiency(prediction, device, flops, published)
        table.append([
            str(index), model.name, str(layout.devices),
            f"tp {layout.tensor_parallel} pp {layout.pipeline_parallel} dp {layout.data_parallel}"
            + (f" v {layout.virtual_stages}" if layout.virtual_stages > 1 else ""),
            f"{published}", f"{tflops:.0f}",
            f"{error:+.0%}" + ("" if abs(error) <= TOLERANCE else " !"),
            "" if layout.virtual_stages == 1 else
            f"{plain_tflops:.0f} ({plain_tflops / published - 1:+.0%})",
            share, f"{efficiency:.2f} (table {device.matmul_efficiency:.2f})",
            f"{prediction.peak_memory_bytes / 1e9:.0f}",
        ])  # fmt: skip
        if not args.no_search:
            found = search.search(
                model, device, layout.devices, layout.global_batch, SPACE, top=1,
                amp="master", overlap_grad_reduce=layout.overlap_grad_reduce,
                rank_order="tp,dp,pp",
            )  # fmt: skip
            searches.append((index, model.name, prediction, found.best, flops))
            print(f"row {index} searched ({found.evaluated} predictions)", file=sys.stderr)
    print("Predicted TFLOP/s per GPU (the paper's FLOP count) against the published runs:")
    _print(table)
    if not args.rows:
        runs, layers = korthikanti_tables()
        print("\nThe same code base a year later (Korthikanti et al. 2022, Tables 5 and 4; "
              "full recomputation, no data parallelism):")  # fmt: skip
        _print(runs)
        print()
        _print(layers)
    if searches:
        print("\nThe search on the same GPUs and batch (space: tp 1-8 within a node, any pipeline"
              " depth, micro-batch 1-16, every schedule (2 or 3 interleaved chunks), zero none /"
              " v1, gc and offload as needed):")  # fmt: skip
        rows = [["row", "published layout", "step s", "search's best", "step s", "speed-up",
                 "saved (share of the published step)"]]  # fmt: skip
        for index, _name, published, best, _flops in searches:
            rows.append(_compare(index, published, best))
        _print(rows)


def _case(index):
    """(model, layout, device with its node size, paper FLOPs, published TFLOP/s)."""
    model, layout, device, flops, published = (
        zero_case() if index == 11 else row_case(MEGATRON[index - 1])
    )
    device = dataclasses.replace(device, devices_per_node=16 if index == 11 else 8)
    return model, layout, device, flops, published


def _error(model, layout, device, flops, published):
    tflops = flops / step_time.predict(model, layout, device).step_time_s
    return tflops / (layout.devices * 1e12) / published - 1


# Each variant takes one term out: (label, the device's fields it replaces, given the
# device; the layout's fields it replaces; whether the gradient accumulation pass is left
# out). The wave term is also shown with cuBLAS's smaller tiles among those a product may
# pick (they reuse less data, at a rate the guide does not give).
_SMALLER_TILES = ((128, 64), (64, 128), (64, 64))
_ABLATIONS = [
    ("all terms", lambda d: {}, {}, False),
    ("no gradient accumulation pass", lambda d: {}, {}, True),
    ("no wave quantization (sm_count 0)", lambda d: {"sm_count": 0}, {}, False),
    ("also cuBLAS's smaller tiles",
     lambda d: {"matmul_tiles": d.matmul_tiles + _SMALLER_TILES}, {}, False),
    ("memory at the datasheet's rate", lambda d: {"memory_efficiency": 1.0}, {}, False),
    ("NVLink at line rate", lambda d: {"intra_node_efficiency": 1.0}, {}, False),
    ("no ZeRO-R partitioned checkpoints", lambda d: {}, {"partition_activations": False},
     False),
]  # fmt: skip


def ablations(chosen):
    """A table of each row's error with one term of the model taken out at a time."""
    rows = [["variant", *(str(i) for i in chosen)]]
    for label, device_fields, layout_fields, no_accumulation in _ABLATIONS:
        line = [label]
        for index in chosen:
            model, layout, device, flops, published = _case(index)
            if layout_fields and all(getattr(layout, k) == v for k, v in layout_fields.items()):
                line.append("")  # the term is not in this row
                continue
            device = dataclasses.replace(device, **device_fields(device))
            layout = dataclasses.replace(layout, **layout_fields)
            without = mock.patch.object(step_time, "accumulation_bytes", lambda *_: 0.0)
            with without if no_accumulation else contextlib.nullcontext():
                line.append(f"{_error(model, layout, device, flops, published):+.0%}")
        rows.append(line)
    return rows


def _compare(index, published, best):
    """A row of the search table: the published layout's and the search's best predicted
    step times; why the best is faster (the terms it saves most, as shares of the
    published layout's step)."""
    if best is None:
        return [str(index), published.layout.describe(), "", "nothing fits", "", "", ""]
    same = all(getattr(best.layout, f) == getattr(published.layout, f)
               for f in ("tensor_parallel", "pipeline_parallel", "schedule", "gc"))  # fmt: skip
    if same or best.step_time_s >= published.step_time_s * 0.995:
        why = "finds the published layout" if same else "no layout predicted faster"
    else:
        deltas = {k: published.terms.get(k, 0) - v for k, v in best.terms.items()}
        saved = sorted(deltas.items(), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{k} -{v / published.step_time_s:.0%}" for k, v in saved)
    return [
        str(index), published.layout.describe(), f"{published.step_time_s:.3g}",
        best.layout.describe(), f"{best.step_time_s:.3g}",
        f"{published.step_time_s / best.step_time_s:.2f}x", why,
    ]  # fmt: skip


def _print(rows):
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
