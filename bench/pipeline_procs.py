"""Pipeline speed with one process per stage, each on its own core, against one core.

Usage: python bench/pipeline_procs.py [--steps 10] [--warmup 3] [--batch 2048] [--width 1024]
                                      [--micro_batches 4,8]
                                      [--schedules 1F1B,ZB-H1,GPipe,Interleaved]
                                      [--repeat 3] [--no-task_clock] [--quick]

Two stages, each in its own worker process (TF_CONFIG on 127.0.0.1, one logical device
each, stage i on worker i), pinned to core i with `os.sched_setaffinity` before
TensorFlow starts and running one intra-op thread (`tf.config.threading`: no config key
or EPL_ variable sets the thread pools; see `pin_and_configure`). Activations and their
gradients cross between the processes on TensorFlow's collective runtime.

Baseline: one process on one core (same pinning and threads) running plain Keras `fit`
on the same global batch, without micro-batches: the fastest way to train that batch on
one core, so the speedup is what a user gains. The same process also times EPLTrainer on
one device with the pipeline's micro-batching ("1-dev"): the pipeline against that
isolates the bubble, the transfers and the per-process overhead from what micro-batching
costs on its own (smaller matmuls, and one accumulation of the gradients per micro-batch).

Interleaved (pipeline.strategy="Interleaved1F1B", pipeline.virtual_stages=2) cuts the same
8 layers into 4 stages of 2 and runs them on the same 2 processes: process 0 holds stages
0 and 2, process 1 stages 1 and 3 (each process the same layers' worth of work as above),
so every micro-batch crosses between the processes three times each way instead of once.

Model: 8 x Dense(width), 4 per stage, MSE against random targets, SGD. The input is 1.5 x
width wide so that both stages do equal work (stage 0 computes no gradient for the
model's input; its wider first layer makes up for it): 12 width^2 multiply-adds per
sample per stage and step. The two workers' measured CPU times agree within 2%.

Every process times its steps with `time.perf_counter` at each batch end (after a warm-up
that traces the step) and `time.process_time` (CPU seconds of all its threads): "busy" is
a worker's CPU time over the wall time of the timed steps; with equal stages and free
transfers it would be m/(m+S-1).

The schedule table: each worker also times every task of its stage in the graph
(`pipeline.TaskClock`: a `tf.timestamp` at the task's start, once the stage's previous
task and its inputs are there, and at its end). Per timed step, the measured bubble is
1 - (the tasks' time summed over both stages) / (2 x (last end - first start)), next to
the formula with equal F, B, W costs (`schedule.bubble_fraction`); the table gives its
mean over the timed steps. Peak memory per stage: the allocator's peak over the timed
steps (`tf.config.experimental.get_memory_info`, reset after the warm-up; each process
holds one stage), and that peak above the memory held at the reset (weights, optimizer
state), which is what the schedule changes: activations and gradients.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, REPO)

STAGES = 2
LAYERS_PER_STAGE = 4
# pipeline.strategy
SCHEDULES = {"1F1B": "PreferBackward", "GPipe": "PreferForward", "ZB-H1": "ZeroBubbleH1",
             "Interleaved": "Interleaved1F1B"}  # fmt: skip
VIRTUAL_STAGES = {"Interleaved": 2}  # pipeline.virtual_stages: stages per process
PROCESS_TIMEOUT = 600  # seconds for one child process (start, trace, warm-up and steps)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing)")
    parser.add_argument("--batch", type=int, default=2048, help="global batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro_batches", default="4,8")
    parser.add_argument(
        "--schedules",
        default="1F1B,ZB-H1",
        help="pipeline.strategy: a comma-separated subset of 1F1B, ZB-H1, GPipe, Interleaved",
    )
    parser.add_argument("--inter_op", type=int, default=2, help="inter-op threads per process")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the pipeline runs (each round runs every schedule and m once); the "
        "schedule table gives the median and the range over the rounds",
    )
    parser.add_argument(
        "--task_clock",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each task in the graph (the measured bubble); --no-task_clock measures "
        "the throughput without those timestamps",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes to check that it runs (numbers mean nothing)",
    )
    # Child modes, started by the orchestrator.
    parser.add_argument(
        "--role", choices=["orchestrate", "worker", "single"], default="orchestrate"
    )
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.batch, args.width = 3, 2, 32, 64
    args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    args.schedules = args.schedules.split(",")
    unknown = [name for name in args.schedules if name not in SCHEDULES]
    if unknown:
        raise ValueError(
            f"--schedules takes {', '.join(SCHEDULES)}. Received: {','.join(args.schedules)}"
        )
    for m in args.micro_batches:
        if m < 1 or args.batch % m:
            raise ValueError(
                "Every micro-batch count must divide the global batch. "
                f"Received: batch={args.batch}, micro_batches={args.micro_batches}"
            )
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1. Received: repeat={args.repeat}")
    if args.steps < 1 or args.warmup < 1:
        raise ValueError(
            f"--steps and --warmup must be >= 1. Received: steps={args.steps}, warmup={args.warmup}"
        )
    return args


# ---- child processes: one core, one intra-op thread ------------------------------------


def pin_and_configure(core: int, inter_op: int) -> None:
    """Pins this process to `core`, then sets TensorFlow's thread pools.

    The affinity must be set before TensorFlow is imported: its thread pools start with
    the process's affinity mask. The pools are set with `tf.config.threading`, not
    `configure_tensorflow(intra_op_threads=...)`: `epl.init` calls that function again,
    and its second call lists the devices, which starts TensorFlow before the
    multi-worker collective runtime can be configured.
    """
    os.sched_setaffinity(0, {core})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def make_model(width: int):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((width * 3 // 2,))
    h = inputs
    for s in range(STAGES):
        for i in range(LAYERS_PER_STAGE):
            last = s == STAGES - 1 and i == LAYERS_PER_STAGE - 1
            h = keras.layers.Dense(
                width, activation=None if last else "relu", name=f"s{s}_dense{i}"
            )(h)
    return keras.Model(inputs, h)


def make_dataset(args):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * args.batch, args.width * 3 // 2)).astype("float32")
    y = rng.normal(size=(2 * args.batch, args.width)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
    return dataset.cache().repeat().prefetch(1)


def timed_fit(fit, args, task_clock=None, memory=False) -> dict:
    """Runs `fit(callbacks, steps)` over warm-up + timed steps; times the timed ones.
    With `task_clock`, also each timed step's task times; with `memory`, the peak memory."""
    import keras
    import tensorflow as tf

    wall, cpu, tasks, measure_memory, memory = [], [], [], memory, {}

    class StepClock(keras.callbacks.Callback):
        # It reads no weights: without this, EPLTrainer writes the weights back into the
        # Keras model after every step (a callback may read them, as in Keras), and with
        # stages on different workers that is an all-reduce of the whole model per step.
        reads_logs_only = True

        def on_train_batch_end(self, batch, logs=None):
            wall.append(time.perf_counter())
            cpu.append(time.process_time())
            if batch >= args.warmup and task_clock is not None:
                tasks.append([(s, str(t), a, b) for s, t, a, b in task_clock.read()])
            if measure_memory and batch == args.warmup - 1:  # the warm-up traced and built
                memory["held"] = tf.config.experimental.get_memory_info("CPU:0")["current"]
                tf.config.experimental.reset_memory_stats("CPU:0")

    fit([StepClock()], args.warmup + args.steps)
    if memory:
        memory["peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    first, last = args.warmup - 1, args.warmup + args.steps - 1
    seconds = wall[last] - wall[first]
    return {
        "samples_per_sec": args.steps * args.batch / seconds,
        "step_ms": 1e3 * seconds / args.steps,
        "busy": (cpu[last] - cpu[first]) / seconds,
        "cpu_ms_per_step": 1e3 * (cpu[last] - cpu[first]) / args.steps,
        "tasks": tasks,
        **memory,
    }


def thread_settings() -> dict:
    import tensorflow as tf

    return {
        "affinity": sorted(os.sched_getaffinity(0)),
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
    }


def run_worker(args) -> None:
    """One stage of the pipeline: this process is worker `TF_CONFIG.task.index`."""
    pin_and_configure(args.core, args.inter_op)
    import keras

    import epl_trainer as epl
    from epl_trainer.core.engine.pipeline import TaskClock

    (num_micro_batch,), (schedule,) = args.micro_batches, args.schedules
    virtual = VIRTUAL_STAGES.get(schedule, 1)
    env = epl.init(
        {
            "pipeline.num_micro_batch": num_micro_batch,
            "pipeline.strategy": SCHEDULES[schedule],
            "pipeline.virtual_stages": virtual,
        }
    )
    # Layer i of the 8 goes to stage i // (layers per stage); with v stages per process,
    # stage k runs on process k mod STAGES (the planner's round-robin).
    per_stage = LAYERS_PER_STAGE // virtual
    trainer = epl.EPLTrainer(
        make_model(args.width),
        "mse",
        keras.optimizers.SGD(0.01),
        stages={
            f"s{s}_dense{i}$": (s * LAYERS_PER_STAGE + i) // per_stage
            for s in range(STAGES)
            for i in range(LAYERS_PER_STAGE)
        },
    )
    dataset = make_dataset(args)  # data_shards is 1: both workers read the global batch
    # The clock goes into the step's hooks after the engine is built, before its first trace.
    clock = TaskClock() if args.task_clock else None
    trainer.runtime.ensure_for(dataset).program.hooks.task_clock = clock

    def fit(callbacks, steps):
        trainer.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0)

    result = timed_fit(fit, args, clock, memory=True)
    result.update(
        thread_settings(),
        worker=env.cluster.worker_index,
        data_shards=trainer.data_shards,
        plan=trainer.plan.summary(),
    )
    with open(args.out, "w") as f:
        json.dump(result, f)


def run_single(args) -> None:
    """The baselines on one core: Keras fit, then EPLTrainer on 1 device per micro-batch count."""
    pin_and_configure(args.core, args.inter_op)
    import keras

    import epl_trainer as epl

    dataset = make_dataset(args)
    model = make_model(args.width)
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=1)

    def keras_fit(callbacks, steps):
        model.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0)

    results = {"keras": timed_fit(keras_fit, args), **thread_settings()}
    for m in args.micro_batches:
        trainer = epl.EPLTrainer(
            make_model(args.width),
            "mse",
            keras.optimizers.SGD(0.01),
            config={"cluster.virtual_devices": 1, "pipeline.num_micro_batch": m},
        )

        def epl_fit(callbacks, steps, trainer=trainer):
            trainer.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0)

        results[f"epl_{m}"] = timed_fit(epl_fit, args)
    with open(args.out, "w") as f:
        json.dump(results, f)


# ---- the orchestrator: starts the children one configuration at a time ------------------


def child_command(args, role: str, core: int, out: str, micro_batches, schedules) -> list:
    return [
        sys.executable,
        os.path.abspath(__file__),
        f"--role={role}",
        f"--core={core}",
        f"--out={out}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--width={args.width}",
        f"--inter_op={args.inter_op}",
        "--task_clock" if args.task_clock else "--no-task_clock",
        "--micro_batches=" + ",".join(str(m) for m in micro_batches),
        "--schedules=" + ",".join(schedules),
    ]


def wait_all(processes: list, logs: list) -> None:
    """Waits for every child; on a failure or timeout stops the others and shows its log."""
    deadline = time.monotonic() + PROCESS_TIMEOUT
    try:
        while any(p.poll() is None for p in processes):
            failed = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                which = failed[0] if failed else 0
                with open(logs[which]) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(
                    f"Child {which} {'failed' if failed else 'timed out'} "
                    f"(exit code {processes[which].poll()}). Last log lines:\n{tail}"
                )
            time.sleep(0.5)
        for i, p in enumerate(processes):
            if p.returncode != 0:
                with open(logs[i]) as f:
                    raise RuntimeError(f"Child {i} exited with {p.returncode}:\n{f.read()[-3000:]}")
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(command: list, env: dict, log: str) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def measure_single(args, core: int, tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    out, log = os.path.join(tmp, "single.json"), os.path.join(tmp, "single.log")
    process = start(
        child_command(args, "single", core, out, args.micro_batches, args.schedules), env, log
    )
    wait_all([process], [log])
    with open(out) as f:
        return json.load(f)


def measure_pipeline(args, schedule: str, num_micro_batch: int, cores: list, tmp: str) -> list:
    from epl_trainer.runtime.launcher import free_ports  # no TensorFlow in this process

    ports = free_ports(STAGES)
    workers = [f"127.0.0.1:{port}" for port in ports]
    processes, logs, outs = [], [], []
    for index in range(STAGES):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        )
        env["EPL_CLUSTER_VIRTUAL_DEVICES"] = "1"
        name = f"pipe_{schedule}_m{num_micro_batch}_w{index}"
        outs.append(os.path.join(tmp, f"{name}.json"))
        logs.append(os.path.join(tmp, f"{name}.log"))
        command = child_command(
            args, "worker", cores[index], outs[-1], [num_micro_batch], [schedule]
        )
        processes.append(start(command, env, logs[-1]))
    wait_all(processes, logs)
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def print_tables(args, single: dict, pipelines: dict) -> None:
    from epl_trainer.core.plan.schedule import bubble_fraction

    keras_rate = single["keras"]["samples_per_sec"]
    print(
        f"\n{STAGES} stages x {LAYERS_PER_STAGE} Dense({args.width}) (input "
        f"{args.width * 3 // 2}), MSE, SGD; global batch {args.batch}; one process per "
        f"stage, each pinned to its own core, intra-op threads 1, inter-op {args.inter_op}; "
        f"{args.warmup} warm-up + {args.steps} timed steps; {os.cpu_count()} cores"
    )
    print(
        f"baseline: plain Keras fit, batch {args.batch}, one process on one core: "
        f"{keras_rate:.1f} samples/s ({single['keras']['step_ms']:.1f} ms/step)\n"
    )
    header = (
        "schedule",
        "m",
        "pipeline samples/s",
        "single samples/s",
        "speedup",
        "efficiency",
        "ideal m/(m+S-1)",
        "eff/ideal",
    )
    widths = (11, 3, 18, 16, 7, 10, 15, 9)
    rows = []
    for (schedule, m), workers in pipelines.items():
        rate = workers[0]["samples_per_sec"]
        speedup = rate / keras_rate
        ideal = 1 - bubble_fraction(STAGES, m)
        cells = (
            schedule,
            str(m),
            f"{rate:.1f}",
            f"{keras_rate:.1f}",
            f"{speedup:.2f}x",
            f"{speedup / STAGES:.2f}",
            f"{ideal:.2f}",
            f"{speedup / STAGES / ideal:.2f}",
        )
        rows.append(cells)
    print_table(header, widths, rows)
    print(
        "\nWhere the time goes. 1-dev: EPLTrainer on one device with the same micro-batches, "
        "one core;\nms/step and CPU ms/step (all threads); busy = CPU time / wall time "
        "during the timed steps."
    )
    header = (
        "schedule",
        "m",
        "1-dev ms",
        "1-dev cpu ms",
        "pipe ms",
        "w0 cpu ms",
        "w1 cpu ms",
        "w0 busy",
        "w1 busy",
        "eff vs 1-dev / ideal",
    )
    widths = (11, 3, 8, 12, 8, 9, 9, 7, 7, 20)
    rows = []
    for (schedule, m), workers in pipelines.items():
        one = single[f"epl_{m}"]
        ideal = 1 - bubble_fraction(STAGES, m)
        cells = (
            schedule,
            str(m),
            f"{one['step_ms']:.1f}",
            f"{one['cpu_ms_per_step']:.1f}",
            f"{workers[0]['step_ms']:.1f}",
            f"{workers[0]['cpu_ms_per_step']:.1f}",
            f"{workers[1]['cpu_ms_per_step']:.1f}",
            f"{workers[0]['busy']:.2f}",
            f"{workers[1]['busy']:.2f}",
            f"{one['step_ms'] / workers[0]['step_ms'] / STAGES / ideal:.2f}",
        )
        rows.append(cells)
    print_table(header, widths, rows)


def measured_bubble(workers: list) -> float:
    """The mean over timed steps of 1 - busy / (stages x span), from both workers' tasks
    (NaN without --task_clock)."""
    bubbles = []
    for step in zip(*(w["tasks"] for w in workers)):
        tasks = [task for worker_tasks in step for task in worker_tasks]
        busy = sum(end - start for _, _, start, end in tasks)
        span = max(end for *_, end in tasks) - min(start for _, _, start, _ in tasks)
        bubbles.append(1 - busy / (STAGES * span))
    return sum(bubbles) / len(bubbles) if bubbles else float("nan")


def print_schedule_table(rounds: list[dict]) -> None:

    print(
        "\nThe schedules. bubble: measured from the executed tasks' timestamps (mean of the "
        "timed steps) and by formula (equal F, B, W costs); throughput, and against 1F1B at "
        "the same m in the same round; peak: each stage's allocator peak over the timed "
        "steps (MB), and above the memory held after the warm-up (weights, optimizer "
        f"state). Medians over {len(rounds)} round(s), [min, max] where more than one."
    )
    header = ("schedule", "m", "bubble", "formula", "samples/s", "vs 1F1B",
              "peak s0", "peak s1", "above held s0", "above held s1")  # fmt: skip
    widths = (11, 3, 7, 7, 9, 21, 8, 8, 13, 13)
    rows = []
    for schedule, m in rounds[0]:
        runs = [r[schedule, m] for r in rounds]
        versus = "-"
        if ("1F1B", m) in rounds[0]:
            ratios = [
                w[0]["samples_per_sec"] / r["1F1B", m][0]["samples_per_sec"]
                for w, r in zip(runs, rounds)
            ]
            versus = _median_range(ratios, "{:.3f}x")
        cells = (
            schedule,
            str(m),
            _median_range([measured_bubble(w) for w in runs], "{:.3f}", spread=False),
            f"{formula_bubble(schedule, m):.3f}",
            _median_range([w[0]["samples_per_sec"] for w in runs], "{:.0f}", spread=False),
            versus,
            *(_median_range([w[k]["peak"] / 2**20 for w in runs], "{:.1f}", spread=False)
              for k in range(STAGES)),
            *(_median_range([(w[k]["peak"] - w[k]["held"]) / 2**20 for w in runs], "{:.1f}",
                            spread=False) for k in range(STAGES)),
        )  # fmt: skip
        rows.append(cells)
    print_table(header, widths, rows)


def formula_bubble(schedule: str, m: int) -> float:
    """The schedule's bubble by formula on STAGES processes (equal F, B, W costs)."""
    from epl_trainer.core.plan.schedule import bubble_fraction

    virtual = VIRTUAL_STAGES.get(schedule, 1)
    return bubble_fraction(STAGES * virtual, m, SCHEDULES[schedule], virtual)


def _median_range(values: list, form: str, spread: bool = True) -> str:
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    text = form.format(median)
    if spread and len(ordered) > 1:
        text += f" [{form.format(ordered[0])}, {form.format(ordered[-1])}]"
    return text


def orchestrate(args) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < STAGES:
        raise RuntimeError(
            f"A {STAGES}-stage pipeline with one core per stage needs {STAGES} cores. "
            f"Received: cores available={cores}"
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipeline_procs_") as tmp:
        single = measure_single(args, cores[0], tmp)
        print(f"single process done ({time.perf_counter() - started:.0f} s)", flush=True)
        rounds = []
        for r in range(args.repeat):  # rounds, so slow spells of the machine hit all alike
            pipelines = {}
            for schedule in args.schedules:
                for m in args.micro_batches:
                    pipelines[schedule, m] = measure_pipeline(args, schedule, m, cores, tmp)
                    elapsed = time.perf_counter() - started
                    print(f"round {r}: {schedule} m={m} done ({elapsed:.0f} s)", flush=True)
            rounds.append(pipelines)
        pipelines = rounds[0]
    for workers in (w for pipelines in rounds for w in pipelines.values()):
        for w in workers:  # what the table claims: one core, one thread, one input shard
            assert w["intra_op"] == 1 and len(w["affinity"]) == 1, w
            assert w["data_shards"] == 1, w
    first = next(iter(pipelines.values()))
    print(f"\nPlan (worker 0, {next(iter(pipelines))}):\n{first[0]['plan']}")
    print_tables(args, single, pipelines)  # the first round's
    print_schedule_table(rounds)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


def print_table(header, widths, rows) -> None:
    """Columns left-aligned to `widths`, a rule under the header."""
    for cells in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)))


def main():
    args = parse_args()
    {"worker": run_worker, "single": run_single, "orchestrate": orchestrate}[args.role](args)


if __name__ == "__main__":
    main()
