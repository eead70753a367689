"""Trace cost of the training step: time to trace and graph size vs stages x micro-batches.

Usage: python bench/trace.py [--layers 12] [--stages 1 2 4] [--micro_batches 1 2 4 8]

A 12-layer BERT (model_zoo.bert_squad, hidden 64) is cut into S stages on S logical
devices and traced with M micro-batches. The step is built by Python: one forward and
one backward per (stage, micro-batch), so its ops grow with S x M. Prints, per
configuration, the seconds `get_concrete_function` took, the ops of the step's graph
and of the functions it calls, and the ops per (stage, micro-batch) task.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def graph_ops(graph) -> int:
    """Ops of a FuncGraph and of every function in its library."""
    library = graph.as_graph_def().library
    return len(graph.get_operations()) + sum(len(f.node_def) for f in library.function)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--micro_batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()

    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(max(args.stages))
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl
    from model_zoo.bert_squad.modeling import BertConfig, build_squad_model

    bert = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    seq = 32
    print(f"BERT with {args.layers} layers, hidden 64, sequence {seq}")
    print(f"{'stages':>6} {'micro':>5} {'trace s':>8} {'ops':>8} {'ops/task':>9}")
    for stages in args.stages:
        for micro in args.micro_batches:
            keras.utils.set_random_seed(0)
            model = build_squad_model(bert, seq)
            last = stages - 1
            stage_of = {"embeddings": 0, "qa_outputs|start_logits|end_logits": last}
            for i in range(args.layers):
                stage_of[f"layer_{i}"] = i * stages // args.layers
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            trainer = epl.EPLTrainer(
                model,
                loss={"start_logits": loss, "end_logits": loss},
                optimizer=keras.optimizers.Adam(1e-3),
                stages={name: stage for name, stage in stage_of.items()} if stages > 1 else None,
                config={"cluster.virtual_devices": stages, "pipeline.num_micro_batch": micro},
            )
            batch = 8 * micro
            x = {
                name: np.ones((batch, seq), "int32")
                for name in ("input_ids", "input_mask", "segment_ids")
            }
            y = {name: np.zeros(batch, "int32") for name in ("start_logits", "end_logits")}
            dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
            engine = trainer.runtime.ensure_for(dataset)
            start = time.perf_counter()
            graph = engine.train_on_iterator.get_concrete_function(iter(dataset)).graph
            seconds = time.perf_counter() - start
            ops = graph_ops(graph)
            tasks = 2 * stages * micro
            print(f"{stages:>6} {micro:>5} {seconds:8.1f} {ops:>8} {ops / tasks:9.0f}")


if __name__ == "__main__":
    main()
