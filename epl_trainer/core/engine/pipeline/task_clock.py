"""The executed schedule: when each local task of a training step started and ended.

`StepHooks.task_clock` is None unless something measures the pipeline
(bench/pipeline_procs.py sets a `TaskClock` before the first step). Each task then gets
two `tf.timestamp` ops (seconds on the host's clock, comparable between the processes
of one machine): its start waits for what the task waits for (the stage's previous
task, and the activations or gradients it reads), its end for the tensors that end it.
The last step's times are kept in a variable per lane, read after the step.

TensorFlow runs stateful ops that use no resource, such as `tf.timestamp`, in program
order, so the timestamps of one process follow the emission order. In a process that
runs one stage this is the stage's own order, which its tasks keep anyway.
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
        self._variables: dict[int, tf.Variable] = {}

    def begin(self, lane: int) -> None:
        """Called at the start of each trace of lane `lane`'s tasks."""
        self.tasks[lane], self._times[lane] = [], []

    def start(self, waits_for: list) -> None:
        with tf.control_dependencies([t for t in waits_for if t is not None]):
            self._started = tf.timestamp()

    def end(self, lane: int, stage: int, task: Task, markers: list) -> None:
        with tf.control_dependencies([t for t in markers if t is not None]):
            ended = tf.timestamp()
        self.tasks[lane].append((stage, task))
        self._times[lane].append(tf.stack([self._started, ended]))

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
