"""EPLTrainer's loss, metrics and logs: compile()'s structures resolved by Keras's own
`CompileLoss` / `CompileMetrics` (losses.py, metrics.py), built from the first data's
shapes as Keras's first `fit` builds them, and the logs under Keras's keys."""

from __future__ import annotations

import keras

from epl_trainer.training import compiled
from epl_trainer.training import fit_inputs as fit_lib
from epl_trainer.training.losses import CompiledLoss
from epl_trainer.training.metrics import CompiledMetrics


class ObjectivesMixin:
    """The trainer's `loss`, `metrics`, `loss_tracker` and their logs."""

    def _setup_objectives(self, model, loss, metrics, loss_weights, weighted_metrics) -> None:
        """The loss and metrics as given (arguments, model_fn or compile), resolved at
        the first data (`_build_objectives`)."""
        # A compiled model may have no loss (add_loss only, or predict only), as in Keras;
        # one handed over without compile or a loss predicts, and cannot train or evaluate
        # (`_require_loss`).
        self._loss_missing = loss is None and not getattr(model, "compiled", False)
        names = compiled.output_names(model)
        self.loss = CompiledLoss(loss, names, loss_weights)
        # Keras's weighted_metrics get the data's sample weights (plain metrics do not).
        self.metrics = CompiledMetrics(metrics, weighted_metrics, names)
        self._objectives_spec = None  # the first data's element spec
        self._objectives_built = False
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def _require_loss(self, call: str) -> None:
        """Training and evaluating need a loss (Keras: "You must call `compile()`")."""
        if getattr(self, "_loss_missing", False):
            raise ValueError(
                f"EPLTrainer needs a loss to {call}: pass loss=..., or compile the model with "
                "one (predict needs none). Received: loss=None"
            )

    def _build_objectives(self, element_spec=None) -> None:
        """Builds the loss and metrics (ours and the compiled model's own
        `CompileMetrics`) from the first data's shapes, as Keras's first fit does: its
        `CompileLoss` / `CompileMetrics` match them to the outputs and raise Keras's
        errors. Called with the data's element spec, and again once the model is built
        (an unbuilt model is built at the engine's first batch)."""
        if self._objectives_built:  # later data does not rebuild them (as in Keras)
            return
        if element_spec is not None:
            self._objectives_spec = element_spec
        if self._objectives_spec is None or not self.model.built:
            return
        if self._runs_user_steps:
            # The model's own step uses its own compiled loss and metrics: built as
            # Keras's first fit builds them, so no variable is made inside the step.
            self.model._symbolic_build(data_batch=self._objectives_spec)
            self._objectives_built = True
            return
        batch = compiled.symbolic_batch(self.model, self._objectives_spec)
        _, y, y_pred, sample_weight = batch
        self.loss.build(y, y_pred, sample_weight)
        self.metrics.build(y, y_pred)
        compiled.build_keras_compile_metrics(self.model, batch)
        self._objectives_built = True

    @property
    def _runs_user_steps(self) -> bool:
        """The model's own train_step (or compute_loss, ...) runs (user_steps.py)."""
        planned = getattr(self, "engine_plan", None)
        return planned is not None and bool(planned.user_steps)

    def _named_metrics(self) -> list:
        """[(log key, metric)] in Keras's order: the loss, the compiled metrics (Keras's
        names), each output's loss (several losses). With the model's own steps, the
        model's metrics (`model.metrics`, which its steps update)."""
        if self._runs_user_steps:
            return [(m.name, m) for m in self.model.metrics]
        return [
            (self.loss_tracker.name, self.loss_tracker),
            *((self.metrics.name(m), m) for _, m in self.metrics),
            *((t.name, t) for t in self.loss.trackers),
        ]

    def _reset_metrics(self) -> None:
        for _, metric in self._named_metrics():
            metric.reset_state()

    def _logs(self, step_logs: dict | None = None) -> dict:
        """The metrics' results. With the model's own steps, Keras's rule
        (`Trainer._get_metrics_result_or_logs`): the model's metrics when the step's logs
        name exactly them, else the last step's logs (`step_logs`)."""
        if self._runs_user_steps:
            results = {}
            for metric in self.model.metrics:
                result = metric.result()
                results.update(result if isinstance(result, dict) else {metric.name: result})
            if step_logs is not None and set(step_logs) != set(results):
                return dict(step_logs)
            if self._metric_sync is not None:  # the metrics of every worker's rows
                return self._metric_sync.results(self._named_metrics())
            return {name: fit_lib.log_value(value) for name, value in results.items()}
        named = self._named_metrics()
        if self._metric_sync is not None:
            return self._metric_sync.results(named)
        return {name: fit_lib.log_value(m.result()) for name, m in named}
