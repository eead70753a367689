"""The trainer's loss, metrics and logs: compile()'s structures resolved by Keras's own
`CompileLoss` / `CompileMetrics` (losses.py, metrics.py), built from the first data's
shapes as Keras's first `fit` builds them, and the logs under Keras's keys."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from epl_trainer.core.engine.checkpoint_content import Expected
from epl_trainer.training import compiled
from epl_trainer.training import fit_inputs as fit_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.losses import CompiledLoss
from epl_trainer.training.metrics import CompiledMetrics


class Objectives:
    """The loss, the metrics and the loss tracker of a trainer, and the logs they give.

    Made empty with the trainer; `set` (by the model planner) takes the loss and metrics
    as given (arguments, model_fn or compile), `build` resolves them against the first
    data. With the model's own steps (user_steps.py) the model's compiled loss and
    metrics are the ones that run, and the logs are the model's.
    """

    def __init__(self, context: TrainerContext):
        self._context = context
        self.loss: CompiledLoss | None = None
        self.metrics: CompiledMetrics | None = None
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self._missing = False
        self._spec = None  # the first data's element spec
        self._built = False

    def set(self, model, loss, metrics, loss_weights, weighted_metrics) -> None:
        """The loss and metrics as given, resolved at the first data (`build`)."""
        # A compiled model may have no loss (add_loss only, or predict only), as in Keras;
        # one handed over without compile or a loss predicts, and cannot train or evaluate
        # (`require_loss`).
        self._missing = loss is None and not getattr(model, "compiled", False)
        names = compiled.output_names(model)
        self.loss = CompiledLoss(loss, names, loss_weights)
        # Keras's weighted_metrics get the data's sample weights (plain metrics do not).
        self.metrics = CompiledMetrics(metrics, weighted_metrics, names)
        self._spec = None
        self._built = False

    def require_loss(self, call: str) -> None:
        """Training and evaluating need a loss (Keras: "You must call `compile()`")."""
        if self._missing:
            raise ValueError(
                f"EPLTrainer needs a loss to {call}: pass loss=..., or compile the model with "
                "one (predict needs none). Received: loss=None"
            )

    def build(self, element_spec=None) -> None:
        """Builds the loss and metrics (ours and the compiled model's own
        `CompileMetrics`) from the first data's shapes, as Keras's first fit does: its
        `CompileLoss` / `CompileMetrics` match them to the outputs and raise Keras's
        errors. Called with the data's element spec, and again once the model is built
        (an unbuilt model is built at the engine's first batch)."""
        if self._built:  # later data does not rebuild them (as in Keras)
            return
        if element_spec is not None:
            self._spec = element_spec
        model = self._context.model
        if self._spec is None or not model.built:
            return
        if self._context.runs_user_steps:
            # The model's own step uses its own compiled loss and metrics: built as
            # Keras's first fit builds them, so no variable is made inside the step.
            model._symbolic_build(data_batch=self._spec)
            self._built = True
            return
        batch = compiled.symbolic_batch(model, self._spec)
        _, y, y_pred, sample_weight = batch
        self.loss.build(y, y_pred, sample_weight)
        self.metrics.build(y, y_pred)
        compiled.build_keras_compile_metrics(model, batch)
        self._built = True

    def named(self) -> list:
        """[(log key, metric)] in Keras's order: the loss, the compiled metrics (Keras's
        names), each output's loss (several losses). With the model's own steps, the
        model's metrics (`model.metrics`, which its steps update)."""
        if self._context.runs_user_steps:
            return [(m.name, m) for m in self._context.model.metrics]
        return [
            (self.loss_tracker.name, self.loss_tracker),
            *((self.metrics.name(m), m) for _, m in self.metrics),
            *((t.name, t) for t in self.loss.trackers),
        ]

    def log_names(self) -> set[str]:
        """The keys of Keras's logs (the rest of a step's results are the trainer's own)."""
        return {name for name, _ in self.named()}

    def reset(self) -> None:
        for _, metric in self.named():
            metric.reset_state()

    def state_entries(self) -> list[tuple[str, str, tf.Tensor]]:
        """This worker's running state of the metrics as checkpoint entries [(key, name,
        value)]: `metric/<log key>/<j>@worker<w>` is the j-th variable of the metric
        logged as `<log key>` on worker w. Each worker writes its own (no collective: a
        save that fails on one worker must not leave the others waiting in one)."""
        worker = self._context.cluster.worker_index
        return [
            (
                f"{METRIC_KEY}{name}/{j}{WORKER_MARK}{worker}",
                f"{name} ({variable.path}) of worker {worker}",
                tf.convert_to_tensor(variable.value),
            )
            for name, metric in self.named()
            for j, variable in enumerate(metric.variables)
        ]

    def load_state(self, values: dict) -> None:
        """Puts back the running state `state_entries` saved (a resume mid-epoch), so the
        epoch's logs cover every batch of it, the ones before the checkpoint included.
        Saved by as many workers as this job has, each worker takes its own state: its
        batch logs (this worker's rows) go on as the uninterrupted run's. Else the chief
        takes the sum over the saved job's workers and the other workers zeros, as the
        epoch's logs sum the workers' states (metric_sync.py): the epoch's logs are then
        the saved job's, whatever the worker count. A metric the checkpoint lacks, or
        holds in other shapes, stays reset."""
        cluster = self._context.cluster
        saved_workers = {key.split(WORKER_MARK)[1] for key in values if WORKER_MARK in key}
        own = saved_workers == {str(w) for w in range(cluster.worker_num)}
        summed = {}
        for key, value in values.items():
            base, _, worker = key.partition(WORKER_MARK)
            if own and worker != str(cluster.worker_index):
                continue
            summed[base] = summed[base] + value if base in summed else np.asarray(value)
        takes_state = own or cluster.is_chief
        for name, metric in self.named():
            saved = [summed.get(f"{METRIC_KEY}{name}/{j}") for j in range(len(metric.variables))]
            if not saved or any(
                value is None or tuple(value.shape) != tuple(variable.shape)
                for value, variable in zip(saved, metric.variables)
            ):
                continue
            for value, variable in zip(saved, metric.variables):
                variable.assign(value if takes_state else np.zeros_like(value))

    def logs(self, step_logs: dict | None = None) -> dict:
        """The metrics' results, over every worker's rows. With the model's own steps,
        Keras's rule (`Trainer._get_metrics_result_or_logs`): the model's metrics when
        the step's logs name exactly them, else the last step's logs (`step_logs`)."""
        sync = self._context.metric_sync
        if self._context.runs_user_steps:
            results = {}
            for metric in self._context.model.metrics:
                result = metric.result()
                results.update(result if isinstance(result, dict) else {metric.name: result})
            if step_logs is not None and set(step_logs) != set(results):
                return dict(step_logs)
            if sync is not None:  # the metrics of every worker's rows
                return sync.results(self.named())
            return {name: fit_lib.log_value(value) for name, value in results.items()}
        named = self.named()
        if sync is not None:
            return sync.results(named)
        return {name: fit_lib.log_value(m.result()) for name, m in named}

    def local_logs(self) -> dict:
        """This worker's loss and metrics so far (a batch callback's logs), flattened as
        Keras flattens them: a metric whose result is a dict (a compiled model's
        `CompileMetrics`, which a model's own steps log) gives its items."""
        logs = {}
        for name, metric in self.named():
            result = metric.result()
            if isinstance(result, dict):
                logs.update({key: fit_lib.log_value(value) for key, value in result.items()})
            else:
                logs[name] = fit_lib.log_value(result)
        return logs

    def returned(self, logs: dict, return_dict: bool):
        """`logs` as Keras's evaluate / *_on_batch return them: the dict itself, or
        [loss, *metrics] (the loss alone when there are no metrics)."""
        if return_dict:
            return logs
        # Keras's order (`_flatten_metrics_in_order`): the metrics' own names, so a
        # prefixed name (several outputs) is placed by sorting, as in Keras.
        names = [metric.name for _, metric in self.named()]
        return fit_lib.flatten_logs_in_order(logs, names)


METRIC_KEY = "metric/"  # checkpoint entries of the metrics' running state
WORKER_MARK = "@worker"  # ... one per worker: metric/<log key>/<j>@worker<w>


def saved_state(entries: dict) -> dict[str, Expected]:
    """{key: Expected} of a manifest's metric entries (`Objectives.state_entries`), read
    as they were saved: none in a checkpoint written before they were."""
    return {
        key: Expected(entry["name"], list(entry["shape"]), entry["dtype"], [], optional=True)
        for key, entry in entries.items()
        if key.startswith(METRIC_KEY)
    }
