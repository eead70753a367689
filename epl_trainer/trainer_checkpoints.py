"""EPLTrainer's checkpoints: save, restore, and resuming a run from `checkpoint.dir`.

A checkpoint holds the engine's state keyed by the user's model (checkpoint_content.py:
weights, optimizer slots, the step, the loss scale) plus where training stood (epoch,
step in the epoch, position in the input). Every worker writes the entries it owns into
its own shard; the chief publishes the manifest once all shards are in (checkpoint.py).
A checkpoint restores into any layout: other device or worker counts, stage cuts, ZeRO
levels, split widths, grouped apply or offload.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import tensorflow as tf

from epl_trainer import checkpoint as ckpt
from epl_trainer import model_fn as model_fn_lib
from epl_trainer.core import comm
from epl_trainer.core.engine.checkpoint_content import CheckpointContent

logger = logging.getLogger(__name__)


class SaveAgreement:
    """One tiny all-gather over the workers' host CPUs: `gather([a, b])` returns every
    worker's pair, by worker index. Saves use it twice: to agree on the step and the
    temporary folder (the chief's pid) before writing, and as the barrier after it."""

    def __init__(self, cluster):
        self.cluster = cluster
        hosts = tuple(
            devices[0].rsplit("/device:", 1)[0] + "/device:CPU:0"
            for devices in cluster.devices_by_worker
        )
        self._group = comm.CollectiveGroup(hosts, (cluster.host_device,))
        comm.ordering_token(cluster.host_device)  # before tracing (see end_of_data.py)
        self._gather = tf.function(self._gather_pairs)

    def _gather_pairs(self, pair):
        with tf.device(self.cluster.host_device):
            return self._group.all_gather([tf.identity(pair)])[0]

    def gather(self, pair: list[int]) -> list[list[int]]:
        gathered = self._gather(tf.constant(pair, tf.int64)).numpy().reshape(-1, 2)
        ranks = [self._group.rank_of(device) for device in self._group.devices]
        return [[int(x) for x in gathered[ranks[w]]] for w in range(self.cluster.worker_num)]


class CheckpointMixin:
    """The checkpoint methods of `EPLTrainer` (see trainer.py for the attributes)."""

    def save_checkpoint(
        self, directory: str, keep_max: int | None = None, tag: str | None = None
    ) -> str | None:
        """Saves engine state (weights, optimizer slots, loss scale, step, input position).

        Every worker must call it (the trainer's periodic saves do): each writes the
        entries it owns; the chief publishes once all are in and returns the path (other
        workers return None). The `keep_max` newest `ckpt-<step>` checkpoints are kept
        (all if None). `tag` names the folder, as DeepSpeed's `save_checkpoint(save_dir,
        tag)` (default `ckpt-<step>`; the chief's names it); `keep_max` never deletes a
        tagged one, and `latest` points at it as at any other.
        """
        if self._engine is None:
            raise ValueError("Nothing to save yet: call fit() (or restore) first.")
        if keep_max is not None and keep_max < 1:
            raise ValueError(f"keep_max must be >= 1 or None. Received: keep_max={keep_max}")
        cluster = self.cluster
        step = int(self.optimizer.iterations.numpy())
        ckpt.check_tag(tag, step)
        if cluster.is_chief:
            ckpt.prepare(directory)
        token = os.getpid()
        if cluster.worker_num > 1:
            pairs = self._agree([os.getpid() if cluster.is_chief else 0, step])
            token = pairs[0][0]
            steps = sorted({s for _, s in pairs})
            if len(steps) > 1:
                raise ValueError(
                    "Every worker must save the same step. Received steps by worker: "
                    f"{[s for _, s in pairs]}"
                )
        folder = ckpt.temporary_folder(directory, step, token)
        content = CheckpointContent(self._engine, self.optimizer, cluster.is_chief)
        failure = None
        try:
            entries = content.entries_to_write()
            ckpt.write_shard(
                folder, cluster.worker_index, [(e.key, e.name, e.read()) for e in entries]
            )
        except Exception as error:  # the peers must still meet this worker at the barrier
            failure = error
        if cluster.worker_num > 1:
            written = [ok for ok, _ in self._agree([int(failure is None), 0])]
        else:
            written = [int(failure is None)]
        if failure is not None:
            raise failure
        if not all(written):
            raise ckpt.CheckpointError(
                f"Worker(s) {[w for w, ok in enumerate(written) if not ok]} could not write "
                f"their shard of step {step} into {folder!r}; the checkpoint is not published "
                "(see their logs for the reason)."
            )
        if not cluster.is_chief:
            return None
        metadata = {
            "epochs_done": self.epochs_done,
            # Inside fit: the position in the epoch in progress and in its data pass.
            "step_in_epoch": self._step_in_epoch,
            "input_position": 0 if self._batches is None else self._batches.position,
            "plan": self.plan.summary(),
            "layout": self._layout_record(),
        }
        required = [f"trainable/{i}" for i in range(len(self.model.trainable_variables))]
        required += [f"non_trainable/{i}" for i in range(len(self.model.non_trainable_variables))]
        return ckpt.publish(
            directory, folder, step, cluster.worker_num, metadata, required, keep_max, tag
        )

    def _agree(self, pair: list[int]) -> list[list[int]]:
        if getattr(self, "_save_agreement", None) is None:
            self._save_agreement = SaveAgreement(self.cluster)
        with self._lost_worker_check("a checkpoint save"):
            return self._save_agreement.gather(pair)

    def _layout_record(self) -> dict:
        """The layout that wrote a checkpoint (informative: any layout can restore it)."""
        config = self.config
        return {
            "worker_num": self.cluster.worker_num,
            "lanes": len(self.engine_plan.lanes_in_job),
            "stages": len(self.staged.stages),
            "zero_level": config.zero.level,
            "offload_level": config.offload.level,
            "num_apply_group": config.optimizer.num_apply_group,
            "split_width": self.plan.taskgraphs[0].device_count
            if self.engine_plan.split_layers
            else 0,
        }

    def restore_checkpoint(
        self, directory: str, features=None, tag: str | int | None = None
    ) -> str:
        """Restores a checkpoint of `directory` into every local lane; returns its path.

        `tag` names the checkpoint as DeepSpeed's `load_checkpoint(load_dir, tag)` does:
        its folder name (`"ckpt-100"`) or the step it is named after (`100`); None
        restores the newest (`latest`). An unknown tag is a CheckpointError listing the
        directory's tags; restoring only reads the directory.

        The checkpoint may come from any layout (device or worker count, stage cut, ZeRO
        level, split width...); each worker reads only the entries its layout needs.
        A trainer that has not trained yet needs the model built (functional models are);
        for subclassed models, and for an Estimator-style model_fn, pass one batch of
        `features` to build it.
        """
        path = ckpt.latest(directory) if tag is None else ckpt.tagged(directory, tag)
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
        manifest = ckpt.read_manifest(path)
        content = CheckpointContent(self._engine, self.optimizer, self.cluster.is_chief)
        expected = content.expected()
        unexpected = content.unexpected(manifest["entries"], expected)
        values = ckpt.read_entries(path, manifest, expected, unexpected)
        content.assign({k: np.asarray(v) for k, v in values.items()}, expected)
        self._write_back()  # the Keras model holds the restored state too
        self.epochs_done = manifest.get("epochs_done", 0)
        self._step_in_epoch = manifest.get("step_in_epoch", 0)
        self._resume_position = (self._step_in_epoch, manifest.get("input_position", 0))
        self._restored = True  # the next fit continues the epoch count up to `epochs`
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
