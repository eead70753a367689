"""The executed schedule: when each local task of a training step started and ended.

`StepHooks.task_clock` is None unless something measures the pipeline
(bench/pipeline_procs.py sets a `TaskClock` before the first step). Each task then gets
two `tf.timestamp` ops (seconds on the host's clock, comparable between the processes
of one machine): its start waits for what the task waits for (the stage's previous
task, and the activations or gradients it reads), its end for the tensors that end it.
The last step's times are kept in a variable per lane, read after the step.

TensorFlow runs the stateful ops that use no resource, such as a bare `tf.timestamp` and
the asserts of cross-worker transfers, in program order: timestamps among them made every
transfer wait for the task before it in the program, which cost two stage processes
throughput (docs/benchmarks.md#timestamps-of-the-executed-schedule), and emitted after the
last task they waited for the last transfer. So each timestamp is read in a small function
that takes a variable's handle, which TensorFlow orders only with the other ops that write
that variable: none.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.plan.schedule import Task


class TaskClock:
    """Start and end of every local task of the last training step, per lane."""

    def __init__(self):
        self.tasks: dict[int, list[tuple[int, Task]]] = {}  # lane -> (stage, task), in order
        self._times: dict[int, list] = {}
        self._started = None
        self._ended: dict = {}  # (lane, chain) -> the end stamp of the chain's last task
        self._variables: dict[int, tf.Variable] = {}
        self._anchor = None  # the variable whose handle takes the timestamps out of order

    def begin(self, lane: int) -> None:
        """Called at the start of each trace of lane `lane`'s tasks."""
        self.tasks[lane], self._times[lane] = [], []
        self._ended = {key: v for key, v in self._ended.items() if key[0] != lane}

    def start(self, lane: int, stage: int, waits_for: list, chain: int | None = None) -> None:
        """The task about to be emitted starts once `waits_for` exist and the previous
        task of its chain has ended (`chain`: the stage's device in the schedule, which
        runs several stages under interleaved 1F1B; default the stage)."""
        chain = stage if chain is None else chain
        self._started = self._stamp([*waits_for, self._ended.get((lane, chain))])

    def end(
        self, lane: int, stage: int, task: Task, markers: list, chain: int | None = None
    ) -> None:
        """The task just emitted ends once `markers` exist."""
        self.tasks[lane].append((stage, task))
        # After its start too: a task whose markers are older (stage 0's B of a split
        # backward ends with the task before it) ends when it starts.
        ended = self._stamp([*markers, self._started])
        self._ended[(lane, stage if chain is None else chain)] = ended
        self._times[lane].append(tf.stack([self._started, ended]))

    def _stamp(self, after: list):
        if self._anchor is None:
            with tf.init_scope():
                self._anchor = tf.Variable(0.0, trainable=False)
        with tf.control_dependencies([t for t in after if t is not None]):
            return _timestamp(self._anchor.handle)

    def finish(self, lane: int) -> None:
        """Stores the lane's times of this step (a [tasks, 2] float64 variable)."""
        if not self._times[lane]:
            return
        times = tf.stack(self._times[lane])
        variable = self._variables.get(lane)
        if variable is None or variable.shape != times.shape:
            with tf.init_scope():
                variable = tf.Variable(tf.zeros(times.shape, tf.float64), trainable=False)
            self._variables[lane] = variable
        variable.assign(times)

    def read(self, lane: int = 0) -> list[tuple[int, Task, float, float]]:
        """(stage, task, start, end) of each local task of the lane's last step."""
        values = self._variables[lane].numpy()
        return [(s, t, float(a), float(b)) for (s, t), (a, b) in zip(self.tasks[lane], values)]


@tf.function(autograph=False)
def _timestamp(handle):
    del handle  # only what orders the call: see the module docstring
    return tf.timestamp()
