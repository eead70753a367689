"""EPLTrainer's checkpoints: save, restore, and resuming a run from `checkpoint.dir`.

A checkpoint holds the engine's state under positional names (`Engine.checkpoint_variables`:
weights, optimizer slots, the loss scale, the step) plus where training stood (epoch,
step in the epoch, position in the input), written atomically by checkpoint.py.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from epl_trainer import checkpoint as ckpt
from epl_trainer import model_fn as model_fn_lib

logger = logging.getLogger(__name__)


class CheckpointMixin:
    """The checkpoint methods of `EPLTrainer` (see trainer.py for the attributes)."""

    def save_checkpoint(self, directory: str, keep_max: int | None = None) -> str | None:
        """Saves engine state (weights, optimizer slots, loss scale, step, input position).

        Only worker 0 writes; the `keep_max` newest checkpoints are kept (all if None).
        """
        if self._engine is None:
            raise ValueError("Nothing to save yet: call fit() (or restore) first.")
        if self.config.zero.level and self.cluster.worker_num > 1:
            # Each worker holds only its replicas' optimizer shards; worker 0 alone
            # cannot write them all.
            raise NotImplementedError(
                "save_checkpoint with zero.level across several workers is not implemented "
                f"yet. Received: zero.level={self.config.zero.level!r}, "
                f"worker_num={self.cluster.worker_num}"
            )
        step = int(self.optimizer.iterations.numpy())
        if not self.cluster.is_chief:
            return None
        self._engine.prepare_save()
        metadata = {
            "epochs_done": self.epochs_done,
            # Inside fit: the position in the epoch in progress and in its data pass.
            "step_in_epoch": self._step_in_epoch,
            "input_position": 0 if self._batches is None else self._batches.position,
            "plan": self.plan.summary(),
        }
        variables, names = self._engine.checkpoint_variables(self.optimizer)
        return ckpt.save(directory, variables, metadata, step, names, keep_max)

    def restore_checkpoint(self, directory: str, features=None) -> str:
        """Restores the newest checkpoint in `directory` into every lane.

        A trainer that has not trained yet needs the model built (functional models are);
        for subclassed models, and for an Estimator-style model_fn, pass one batch of
        `features` to build it.
        """
        if self._pending_model_fn is not None:
            if features is None:
                raise ValueError(
                    "restore_checkpoint before the first fit needs `features` (one batch) to "
                    "build the Estimator-style model_fn's model."
                )
            element = tf.data.Dataset.from_tensors(features)
            self._build_from_data(element, model_fn_lib.TRAIN)
        if self._engine is None:
            if features is None and not self.model.built:
                raise ValueError(
                    "restore_checkpoint on a subclassed model that was never called needs "
                    "`features` (one batch) to build it."
                )
            self._ensure_engine(features)
        path = ckpt.latest(directory)
        expected, names = self._engine.checkpoint_variables(self.optimizer)
        values, metadata = ckpt.load(path, expected, names)
        self._engine.restore(expected, values)
        self.epochs_done = metadata.get("epochs_done", 0)
        self._step_in_epoch = metadata.get("step_in_epoch", 0)
        self._resume_position = (self._step_in_epoch, metadata.get("input_position", 0))
        return path

    def _auto_resume(self, dataset) -> bool:
        """checkpoint.dir: a trainer that has not run yet restores the newest checkpoint.

        A damaged newest checkpoint stops here with its CheckpointError rather than
        training from scratch and overwriting the folder's history.
        """
        directory = self.config.checkpoint.dir
        if not directory or self._engine is not None or not ckpt.exists(directory):
            return False
        self._ensure_engine_for(dataset)
        path = self.restore_checkpoint(directory)
        logger.info(
            "Resumed from %s: epoch %d, step %d of it.", path, self.epochs_done, self._step_in_epoch
        )
        return True

    def _save_periodic(self) -> None:
        self.save_checkpoint(self.config.checkpoint.dir, keep_max=self.config.checkpoint.keep_max)
