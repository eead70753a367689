"""The trainer's checkpoints: save, restore, and resuming a run from `checkpoint.dir`.

A checkpoint holds the engine's state keyed by the user's model (checkpoint_content.py:
weights, optimizer slots, the step, the loss scale) plus where training stood (epoch,
step in the epoch, position in the input: progress.py). Every worker writes the entries
it owns into its own shard; the chief publishes the manifest once all shards are in
(checkpoint.py). A checkpoint restores into any layout: other device or worker counts,
stage cuts, ZeRO levels, split widths, grouped apply or offload.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from epl_trainer.core.engine.checkpoint_content import CheckpointContent
from epl_trainer.runtime import elastic
from epl_trainer.training import checkpoint as ckpt
from epl_trainer.training import input_state, shard_file
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training import objectives as objectives_lib
from epl_trainer.training.checkpoint_writer import BackgroundWriter, SaveInFlight
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.engine_runtime import EngineRuntime
from epl_trainer.training.host_agreement import HostAgreement
from epl_trainer.training.model_planning import ModelPlanner
from epl_trainer.training.objectives import Objectives
from epl_trainer.training.progress import TrainingProgress

logger = logging.getLogger(__name__)

# How long a worker waits for the checkpoint the chief chose to become readable (its
# storage may show it later: object stores are eventually consistent).
RESUME_VISIBILITY_SECONDS = 30.0


# A resume's checkpoint name travels as int64s: [status, length, its UTF-8 bytes...].
_NAME_SLOTS = 2 + 128  # checkpoint tags are at most 128 characters (checkpoint._TAG)
_NO_CHECKPOINT, _NAMED, _UNREADABLE = 0, 1, 2


def _encode_choice(status: int, name: str = "") -> list[int]:
    data = list(name.encode("utf-8"))
    return [status, len(data), *data] + [0] * (_NAME_SLOTS - 2 - len(data))


def _decode_choice(row: list[int]) -> tuple[int, str]:
    status, length = row[0], row[1]
    return status, bytes(row[2 : 2 + length]).decode("utf-8")


class CheckpointManager:
    """Saves and restores the trainer's state; resumes `checkpoint.dir` at the first fit.

    Args:
      context: the run's settings.
      runtime: the engine whose state is saved and restored.
      progress: where training stands (saved with the state, restored from it).
      agreement: the workers' agreement on the step, the folder and the checkpoint.
      planner: plans an Estimator-style model_fn's model from `features` (a restore
        before the first fit).
      objectives: the loss and metrics, whose running state a save mid-epoch holds.
    """

    def __init__(
        self,
        context: TrainerContext,
        runtime: EngineRuntime,
        progress: TrainingProgress,
        agreement: HostAgreement,
        planner: ModelPlanner,
        objectives: Objectives,
    ):
        self._context = context
        self._objectives = objectives
        self._runtime = runtime
        self._progress = progress
        self._agreement = agreement
        self._planner = planner
        self._writer = BackgroundWriter()  # checkpoint.async_save's
        self._staging = shard_file.StagingBuffer()  # its shard, assembled for the disk
        self._unsaved_input = None  # why the input state could not be saved (warned once)

    def save(
        self, directory: str, keep_max: int | None = None, tag: str | None = None
    ) -> str | None:
        """`EPLTrainer.save_checkpoint` (its docstring has the arguments)."""
        if self._runtime.engine is None:
            raise ValueError("Nothing to save yet: call fit() (or restore) first.")
        if keep_max is not None and keep_max < 1:
            raise ValueError(f"keep_max must be >= 1 or None. Received: keep_max={keep_max}")
        self.finish_pending()  # one save in flight at most; its failure stops this one
        cluster = self._context.cluster
        step = int(self._context.optimizer.iterations.numpy())
        ckpt.check_tag(tag, step)
        if cluster.is_chief:
            ckpt.prepare(directory)
        folder = ckpt.temporary_folder(directory, step, self._agreed_token(step))
        asynchronous = self._context.config.checkpoint.async_save
        values, failure, inputs = [], None, None
        try:
            values = self._snapshot(to_host=asynchronous)
            inputs = self._save_input_state()  # now: the step's position
            if not asynchronous:
                ckpt.write_shard(folder, cluster.worker_index, values, None, inputs)
        except Exception as error:  # the peers must still meet this worker at the barrier
            failure = error
        publish = self._publisher(directory, folder, step, keep_max, tag)
        # A multi-worker job agrees on an asynchronous save where every worker meets next
        # (finish_pending), so a worker whose snapshot failed reports it there too: were it
        # to wait at the barrier now, its peers would be training on without it.
        if asynchronous and (failure is None or cluster.worker_num > 1):
            path = ckpt.final_path(directory, step, tag) if cluster.is_chief else None
            return self._submit(folder, path, step, values, inputs, publish, failure)
        self._agree_written(failure, step, folder)
        return publish() if cluster.is_chief else None

    def finish_pending(self) -> str | None:
        """Waits for the asynchronous save in flight and publishes it where the main thread
        does (a multi-worker job, once every worker has written its shard). Returns its
        path on the chief (None: no save was in flight, or not the chief). Raises
        CheckpointError when it failed on any worker. Every worker calls it at the same
        point (the next save, a restore, the end of fit)."""
        save = self._writer.join()
        if save is None:
            return None
        if self._context.cluster.worker_num > 1:
            self._agree_written(save.error, save.step, save.folder)
            if save.path is not None and not save.published:
                save.path, save.published = save.publish(), True
        elif save.error is not None:
            raise ckpt.CheckpointError(
                f"The asynchronous save of step {save.step} into {save.folder!r} failed "
                f"({type(save.error).__name__}: {save.error}); it is not published and "
                "'latest' still names the checkpoint before it."
            ) from save.error
        return save.path

    def wait_for_writer(self) -> None:
        """Waits for the writer thread without meeting the other workers (fit is leaving on
        an exception): a single worker's save is then published or failed (logged); a
        multi-worker job's stays unpublished, a torn save the next save removes."""
        save = self._writer.join()
        if save is not None and not save.published and save.error is None:
            logger.warning(
                "The asynchronous save of step %d was written but not published: fit "
                "stopped before the workers agreed that every shard is in.",
                save.step,
            )

    def _agreed_token(self, step: int) -> int:
        """The chief's pid, which names the temporary folder; every worker must save the
        same step."""
        cluster = self._context.cluster
        if cluster.worker_num == 1:
            return os.getpid()
        pairs = self._agreement.gather([os.getpid() if cluster.is_chief else 0, step])
        if len({s for _, s in pairs}) > 1:
            raise ValueError(
                "Every worker must save the same step. Received steps by worker: "
                f"{[s for _, s in pairs]}"
            )
        return pairs[0][0]

    def _snapshot(self, to_host: bool) -> list[tuple[str, str, tf.Tensor]]:
        """This worker's entries [(key, name, value)] as they are now. `to_host`: values on
        an accelerator are copied to host memory (an asynchronous save writes them while
        training goes on; on CPU the read shares the buffer and the next update copies
        it: checkpoint_writer.py)."""
        entries = self._content().entries_to_write()
        with self._runtime.engine.state.gathered_reads():  # every worker, same order
            # Read now: an entry may be the variable itself, which training goes on updating.
            values = [(e.key, e.name, tf.convert_to_tensor(e.read())) for e in entries]
        values += self._objectives.state_entries()  # the epoch's running metrics
        if to_host:
            values = [(key, name, _on_host(value)) for key, name, value in values]
        return values

    def _save_input_state(self) -> dict | None:
        """This worker's input iterator state as it stands now (input_state.py):
        {"position", "state": its bytes, which write_shard stores in the shard},
        {"unsaved": why}, or None outside fit."""
        batches = self._progress.batches
        if batches is None:
            return None
        if not self._context.config.checkpoint.input_state:
            return {"unsaved": "checkpoint.input_state is off"}
        iterator = batches.iterator_to_save()
        if iterator is None:
            return {"unsaved": "saved at the end of fit's last pass, which no pass follows"}
        state = input_state.capture(iterator)
        if not isinstance(state, str):
            return {"position": batches.position, "state": state}
        if state != self._unsaved_input:  # once per reason, not at every save
            self._unsaved_input = state
            logger.warning(
                "The input pipeline's state cannot be saved with the checkpoint (%s): a "
                "resume will skip the batches already taken, which reads the same samples "
                "only if the pipeline gives the same batches in a fresh process.",
                state,
            )
        return {"unsaved": state}

    def _input_to_restore(self, path: str, manifest: dict):
        """For the next fit's first pass: a callable restoring this worker's saved input
        state, or why the checkpoint has none for it (a str)."""
        cluster = self._context.cluster
        shard = manifest["shards"].get(f"shard-{cluster.worker_index}", {})
        saved_workers = manifest.get("layout", {}).get("worker_num", len(manifest["shards"]))
        record = shard.get("input")
        if saved_workers != cluster.worker_num:
            return (
                f"the checkpoint was written by {saved_workers} worker(s) and this job has "
                f"{cluster.worker_num}: each worker's input differs"
            )
        if record is None:
            return (
                "the checkpoint holds no input state (saved outside fit, or by an earlier version)"
            )
        if "unsaved" in record:
            return record["unsaved"]
        if "prefix" in record:  # a TensorFlow checkpoint beside the shard (saved before)
            prefix = ckpt.join_path(path, record["prefix"])
            return lambda iterator: input_state.restore_checkpoint(iterator, prefix)
        try:
            state = ckpt.read_input_state(path, cluster.worker_index, record["state"])
        except ckpt.CheckpointError as error:
            return str(error)
        return lambda iterator: input_state.restore(iterator, state)

    def _agree_written(self, failure: BaseException | None, step: int, folder: str) -> None:
        """The barrier after writing: every worker says whether its shard is in. Raises
        this worker's `failure`, or CheckpointError naming the workers that failed."""
        cluster = self._context.cluster
        if cluster.worker_num > 1:
            written = [ok for ok, _ in self._agreement.gather([int(failure is None), 0])]
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

    def _publisher(self, directory, folder, step, keep_max, tag) -> Callable[[], str]:
        """The chief's publication of this save, with where training stands now (an
        asynchronous save publishes later, after training went on)."""
        metadata = {
            "epochs_done": self._progress.epochs_done,
            # Inside fit: the position in the epoch in progress and in its data pass.
            "step_in_epoch": self._progress.step_in_epoch,
            "input_position": self._progress.input_position,
            "shuffle_seed": self._progress.shuffle_seed,  # the order of shuffled passes
            "plan": self._context.plan.summary(),
            "layout": self._layout_record(),
        }
        model = self._context.model
        required = [f"trainable/{i}" for i in range(len(model.trainable_variables))]
        required += [f"non_trainable/{i}" for i in range(len(model.non_trainable_variables))]
        workers = self._context.cluster.worker_num
        return functools.partial(
            ckpt.publish, directory, folder, step, workers, metadata, required, keep_max, tag
        )

    def _submit(self, folder, path, step, values, inputs, publish, failure) -> str | None:
        """Hands the snapshot to the writer thread; returns `path`, where the chief
        publishes it. `failure`: why the snapshot failed (the writer reports it)."""
        cluster = self._context.cluster
        save = SaveInFlight(step=step, folder=folder, path=path, publish=publish)
        single_chief = cluster.worker_num == 1

        def write():
            if failure is not None:
                raise failure
            ckpt.write_shard(folder, cluster.worker_index, values, self._staging, inputs)
            values.clear()  # the snapshot's memory goes back as soon as it is written
            if single_chief:
                publish()
                save.published = True

        self._writer.submit(save, write)
        return path

    def agreed_latest(self, directory: str) -> str | None:
        """The checkpoint a multi-worker job restores: the one the chief's `latest` names
        (None: the chief sees no checkpoint), once every worker has confirmed it can read
        it. Each worker reading `latest` on its own could resume another step on storage
        that is eventually consistent (object stores), where a worker may still see the
        previous pointer. A worker that cannot read the chosen checkpoint within
        `RESUME_VISIBILITY_SECONDS` fails the restore on every worker, by name.
        """
        is_chief = self._context.cluster.is_chief
        choice, failure = _encode_choice(_NO_CHECKPOINT), None
        if is_chief and ckpt.exists(directory):
            try:
                choice = _encode_choice(_NAMED, os.path.basename(ckpt.latest(directory)))
            except ckpt.CheckpointError as error:
                choice, failure = _encode_choice(_UNREADABLE), error
        chief_choice = self._agreement.gather(choice, "agreeing on the checkpoint")[0]
        status, name = _decode_choice(chief_choice)
        if failure is not None:
            raise failure
        if status == _UNREADABLE:
            raise ckpt.CheckpointError(
                f"The chief (worker 0) could not read the newest checkpoint of {directory!r} "
                "(its log has the reason); no worker restores."
            )
        if status == _NO_CHECKPOINT:
            return None
        problem = _wait_until_readable(directory, name, RESUME_VISIBILITY_SECONDS)
        confirmed = self._agreement.gather([int(problem is None)], "confirming the checkpoint")
        unable = [w for w, (ok,) in enumerate(confirmed) if not ok]
        if unable:
            raise ckpt.CheckpointError(
                f"Worker(s) {unable} cannot read checkpoint {name!r} of {directory!r}, the "
                "newest one the chief sees; no worker restores"
                + (f". This worker: {problem}" if problem else " (their logs have the reason).")
            )
        return name

    def _layout_record(self) -> dict:
        """The layout that wrote a checkpoint (informative: any layout can restore it)."""
        context = self._context
        config, planned = context.config, context.engine_plan
        return {
            "worker_num": context.cluster.worker_num,
            "lanes": len(planned.lanes_in_job),
            "stages": len(planned.staged.stages),
            "zero_level": config.zero.level,
            "offload_level": config.offload.level,
            "num_apply_group": config.optimizer.num_apply_group,
            "split_width": planned.plan.taskgraphs[0].device_count if planned.split_layers else 0,
        }

    def restore(self, directory: str, features=None, tag: str | int | None = None) -> str:
        """`EPLTrainer.restore_checkpoint` (its docstring has the arguments)."""
        self.finish_pending()  # a save in flight is the newest checkpoint once published
        if tag is None and self._context.cluster.worker_num > 1:
            tag = self.agreed_latest(directory)  # the chief's newest, confirmed by all
            if tag is None:
                raise ckpt.CheckpointError(
                    f"No checkpoint in {directory!r}: the chief (worker 0) sees no 'latest'."
                )
        path = ckpt.latest(directory) if tag is None else ckpt.tagged(directory, tag)
        torn = ckpt.torn_saves(directory)
        if torn and self._context.cluster.is_chief:
            logger.warning(
                "Ignoring %s in %r: saves that never finished (their process is gone); "
                "restoring %r. The next save removes them.",
                torn,
                directory,
                os.path.basename(path),
            )
        if self._planner.waits_for_model_fn:
            if features is None:
                raise ValueError(
                    "restore_checkpoint before the first fit needs `features` (one batch) to "
                    "build the Estimator-style model_fn's model."
                )
            element = tf.data.Dataset.from_tensors(features)
            self._planner.build_from_data(element, model_fn_lib.TRAIN)
        if self._runtime.engine is None:
            if features is None and not self._context.model.built:
                raise ValueError(
                    "restore_checkpoint on a subclassed model that was never called needs "
                    "`features` (one batch) to build it."
                )
            self._runtime.ensure(features)
        manifest = ckpt.read_manifest(path)
        content = self._content()
        expected = content.expected()
        unexpected = content.unexpected(manifest["entries"], expected)
        metrics = objectives_lib.saved_state(manifest["entries"])  # the epoch's running metrics
        values = ckpt.read_entries(path, manifest, {**expected, **metrics}, unexpected)
        content.assign({k: np.asarray(v) for k, v in values.items()}, expected)
        self._runtime.write_back()  # the Keras model holds the restored state too
        self._progress.restored_from(manifest)  # the next fit continues from there
        self._progress.resume_input = self._input_to_restore(path, manifest)
        self._progress.resume_metrics = {k: np.asarray(values[k]) for k in metrics if k in values}
        return path

    def auto_resume(self, dataset) -> bool:
        """checkpoint.dir: a trainer that has not run yet restores the newest checkpoint.

        A damaged newest checkpoint stops here with its CheckpointError rather than
        training from scratch and overwriting the folder's history.
        """
        directory = self._context.config.checkpoint.dir
        if not directory or self._runtime.engine is not None:
            return False
        if self._context.cluster.worker_num > 1:
            tag = self.agreed_latest(directory)  # whether to resume is the chief's view too
            if tag is None:
                return False
        elif ckpt.exists(directory):
            tag = None
        else:
            return False
        self._runtime.ensure_for(dataset)
        path = self.restore(directory, tag=tag)
        progress = self._progress
        logger.info(
            "Resumed from %s: epoch %d, step %d of it.",
            path,
            progress.epochs_done,
            progress.step_in_epoch,
        )
        return True

    def save_periodic(self) -> None:
        """checkpoint.dir's save (every checkpoint.save_steps and at each epoch's end);
        an elastic job then stops if a resize was requested."""
        config = self._context.config
        self.save(config.checkpoint.dir, keep_max=config.checkpoint.keep_max)
        step = int(self._context.optimizer.iterations.numpy())
        workers = self._context.cluster.worker_num
        try:
            elastic.stop_if_resize_requested(config, workers, self._agreement.gather, step)
        except elastic.ResizeExit:
            self.finish_pending()  # every worker stops here: the restart resumes this save
            raise

    def _content(self) -> CheckpointContent:
        context = self._context
        return CheckpointContent(self._runtime.engine, context.optimizer, context.cluster.is_chief)


def _on_host(value: tf.Tensor) -> tf.Tensor:
    """`value` in host memory: as is on a CPU device, else copied to the host's CPU."""
    if not _needs_host_copy(value.device):
        return value
    with tf.device("/CPU:0"):
        return tf.identity(value)


def _needs_host_copy(device: str) -> bool:
    """Whether a tensor on `device` lives in an accelerator's memory ("" is the host)."""
    return bool(device) and tf.DeviceSpec.from_string(device).device_type != "CPU"


def _wait_until_readable(directory: str, name: str, seconds: float) -> str | None:
    """None once checkpoint `name` of `directory` and its manifest can be read, else
    (after `seconds`) why not."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            ckpt.read_manifest(ckpt.tagged(directory, name))
            return None
        except ckpt.CheckpointError as error:
            if time.monotonic() >= deadline:
                logger.error("Cannot read checkpoint %r of %r: %s", name, directory, error)
                return str(error)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
