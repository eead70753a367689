"""The trainer's own per-step values, kept out of the callbacks' logs (which are Keras's:
the loss and metrics): throughput, and with AMP the loss scale and skipped steps; and
what a non-finite step means for the run (optimizer.nonfinite_loss)."""

from __future__ import annotations

import logging

from epl_trainer.training import fit_inputs
from epl_trainer.training.context import TrainerContext

logger = logging.getLogger(__name__)


class StepStats:
    """`last` holds the last step's values, `history` the last step of each epoch of the
    latest `fit` (as `History.history` does for the logs).

    Args:
      context: the run's settings (the optimizer's `iterations` numbers the steps;
        optimizer.nonfinite_loss="skip" only warns about a skipped step).
    """

    def __init__(self, context: TrainerContext):
        self._context = context
        self.last: dict = {}
        self.history: dict[str, list] = {}
        self._nonfinite_seen = 0

    def split(self, results: dict, log_names: set[str] | None) -> tuple[dict, dict]:
        """(Keras's logs, the trainer's own values) of a step's results; `log_names`
        None: every result but the trainer's own is a log (a model's own train_step)."""
        logs, stats = {}, {}
        for key, value in results.items():
            is_log = log_names is None or key in log_names
            (logs if is_log else stats)[key] = fit_inputs.log_value(value)
        return logs, stats

    def record(self, stats: dict) -> None:
        self.last.clear()
        self.last.update(stats)

    def end_epoch(self) -> None:
        for key, value in self.last.items():
            self.history.setdefault(key, []).append(value)

    def nonfinite_step(self, epochs_done: int, index: int | None) -> str | None:
        """Where a non-finite step that stops training was skipped ("training step ...
        (epoch, batch)", or "(train_on_batch)" for index None), or None. With
        optimizer.nonfinite_loss="skip" it only warns."""
        count = int(self.last.get("nonfinite_steps", 0))
        if count <= self._nonfinite_seen:
            return None
        self._nonfinite_seen = count
        step = int(self._context.optimizer.iterations.numpy())
        position = f"epoch {epochs_done + 1}, batch {index}"
        where = f"training step {step} ({'train_on_batch' if index is None else position})"
        if self._context.config.optimizer.nonfinite_loss == "skip":
            logger.warning("Non-finite loss at %s: the step was skipped.", where)
            return None
        return where
