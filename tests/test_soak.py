"""Soak: thousands of data-parallel steps leave threads and resident memory flat, and
so do thousands of tensor-parallel steps of a Keras layout map (a Megatron pair computed
sharded and a kernel gathered on use: collectives inside every step).

A per-collective timer thread once made every run longer than a few minutes abort at
~30,000 threads (see epl_trainer/runtime/watchdog.py); short tests never saw it. The soak over
two workers, whose watchdog probes its peer, runs on two hosts (test_hosts.py).
"""

import collections
import glob
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from epl_trainer.training.memory import process_rss_mib, process_threads

STEPS, SAMPLE_EVERY = 3000, 500  # as the soak over two hosts (test_hosts.py)
# Resident memory may still grow by allocator caching and TF's per-function caches, once:
# run after the rest of the slow suite (one 1.6 GB process) RSS rose 6.0 MiB in the first
# 1,000 steps and 0.3 MiB over the next 4,000; in the fresh process each soak runs in,
# 0.05 MiB over 4,000. A leak grows with the steps: 1.6 KiB per step is 4 MiB over the
# 2,500 steps from the first sample, far above that noise. So: at most 4 MiB from the
# first sample on, 16 MiB before it. (The record is bench/soak.py's 50,000 steps.)
RSS_SLACK_MIB = 4.0
RSS_WARMUP_MIB = 16.0
# TF's inter-op and tf.data pools start and retire a few threads as they please; the bug
# this guards against added ~20 threads per step (100,000 over the run).
THREAD_SLACK = 8
# TF runs collectives on an unbounded work queue (its threads named "collective_ops"),
# which keeps an idle thread for reuse: a V2 collective op schedules its parameter
# resolution there (tensorflow/core/kernels/collective_ops.cc: "a work queue that can
# handle blocking work") and then its execution, each waiting for the peers. So the pool
# grows to twice the most collectives ever pending at once, which contention decides (CI,
# beside another test: 16 -> 26 threads by step 4,000; alone: 7 -> 9 collective threads),
# and a step can at most have all of its collectives pending. What ran before the soak
# (the start's broadcast) may have set a higher peak. The pool is checked against the
# larger of the two, every other thread against THREAD_SLACK: a leak of one thread in a
# thousand steps passes neither.
COLLECTIVE_POOL = "collective_ops"


# The soak runs in a fresh process. In the suite's own process (5.3 GB after 1,200 tests)
# RSS crept 5 MiB per 1,000 steps with flat threads; alone the same steps grew 0.02 MiB
# in 4,000: what crept was left by other tests, and would hide or fake a leak of ours.
CHILD = "EPL_SOAK_CHILD"


class OwnStep(keras.Model):
    """A train_step of its own (user_steps.py: a reduction at every apply, lane storage
    swapped while tracing): the same soak must stay flat."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self.compute_metrics(x, y, self(x), sample_weight=None)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["engine", "user", "tensor_parallel"])
def test_thousands_of_data_parallel_steps_keep_threads_and_memory_flat(step):
    if os.environ.get(CHILD):
        _soak(OwnStep if step == "user" else keras.Model, tensor_parallel=step == "tensor_parallel")
        return
    name = "test_thousands_of_data_parallel_steps_keep_threads_and_memory_flat"
    test = f"{__file__}::{name}[{step}]"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
        env={**os.environ, CHILD: "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout


def _tensor_parallel_layouts():
    """On a (1, 2) mesh: up -> down a Megatron pair, the logits' kernel gathered on use."""
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    layout_map["logits/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def thread_names():
    """This process's threads by name (Linux: /proc/self/task/*/comm)."""
    names = collections.Counter()
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as comm:
                names[comm.read().strip()] += 1
        except FileNotFoundError:  # the thread ended while we listed them
            pass
    return names


def collectives_per_step(trainer, dataset):
    """Collective ops one traced step launches, on all lanes, its called functions included."""
    from test_comm_options import all_ops

    graph = trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph
    return sum(op.type.startswith("Collective") for op in all_ops(graph))


def _soak(model_class, tensor_parallel=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    if tensor_parallel:
        hidden = keras.layers.Dense(8, activation="tanh", name="down")(hidden)
    model = model_class(inputs, keras.layers.Dense(4, name="logits")(hidden))
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    trainer = epl.EPLTrainer(
        model,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(1e-3),
        strategy=_tensor_parallel_layouts() if tensor_parallel else epl.replicate(1),
        config={"cluster.virtual_devices": 2, "communication.timeout_seconds": 600},
    )
    if tensor_parallel:
        assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
    else:
        assert trainer.plan.num_replicas == 2
    trainer.fit(dataset, epochs=1, steps_per_epoch=200, verbose=0)  # warm up
    names = thread_names()
    collective_bound = max(2 * collectives_per_step(trainer, dataset), names[COLLECTIVE_POOL])
    assert collective_bound > 0
    threads, rss = process_threads() - names[COLLECTIVE_POOL], process_rss_mib()
    samples = []  # (step, threads outside the collective pool, its threads, RSS)

    def sample(batch, logs):
        if (batch + 1) % SAMPLE_EVERY == 0:
            pool = thread_names()[COLLECTIVE_POOL]
            samples.append((batch + 1, process_threads() - pool, pool, process_rss_mib()))

    probe = keras.callbacks.LambdaCallback(on_train_batch_end=sample)
    history = trainer.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[probe])
    print(
        f"baseline: {threads} threads and {names[COLLECTIVE_POOL]} collective ones (bound "
        f"{collective_bound}), {rss:.1f} MiB; (step, threads, collective, MiB): {samples}"
    )
    assert len(samples) == STEPS // SAMPLE_EVERY
    first = samples[0][3]
    assert first - rss < RSS_WARMUP_MIB, f"RSS grew {first - rss:.1f} MiB in {SAMPLE_EVERY} steps"
    for step, count, pool, resident in samples:
        assert count <= threads + THREAD_SLACK, f"{count} threads at step {step} (from {threads})"
        bound = collective_bound
        assert pool <= bound, f"{pool} collective threads at step {step} (bound {bound})"
        grown = resident - first
        assert grown < RSS_SLACK_MIB, f"RSS grew {grown:.1f} MiB from the first sample to {step}"
    assert history.history["loss"][0] < 1.0  # it trained
