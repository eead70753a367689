"""Where training stands: the epochs done, the step in the epoch in progress, and the
position in the current pass of the data. Checkpoints save it and restore it; the fit
loop advances it; the data feeder numbers the passes over shuffled data by it."""

from __future__ import annotations

import dataclasses

from epl_trainer.training.data import EpochBatches


@dataclasses.dataclass
class TrainingProgress:
    """Attributes:
    epochs_done: every epoch this trainer ran (a resumed one: the job's), across `fit`
      calls; callbacks see Keras's epoch index instead (from `initial_epoch`, each `fit`).
    step_in_epoch: steps run in the epoch in progress.
    batches: the current pass of the data inside `fit` (`EpochBatches`), else None.
    resume_position: (step_in_epoch, input position) a restore left for the next fit.
    restored: a checkpoint was restored since the last fit (the next one continues the
      epoch count up to `epochs`).
    resume_input: what a restore left for the first pass of the next fit: a callable
      restoring the saved tf.data iterator state, or why there is none (a str).
    resume_metrics: the running metrics a restore left for the rest of its epoch
      ({checkpoint key: value}), else None.
    shuffle_seed: the job's seed for the order of shuffled numpy passes (DataFeeder draws
      it once); a checkpoint carries it, so a restored run reshuffles as the saved one
      did whatever the restoring process's random state.
    """

    epochs_done: int = 0
    step_in_epoch: int = 0
    batches: EpochBatches | None = None
    resume_position: tuple[int, int] = (0, 0)
    restored: bool = False
    shuffle_seed: int | None = None
    # What a restore left for the next fit's first pass: `restore(iterator)` putting back
    # the saved input state (input_state.py), or why the checkpoint cannot (a str).
    resume_input: object = None
    resume_metrics: dict | None = None

    @property
    def input_position(self) -> int:
        """Batches taken from the current pass of the data (0 outside fit)."""
        return 0 if self.batches is None else self.batches.position

    def end_epoch(self) -> None:
        self.epochs_done += 1
        self.step_in_epoch = 0

    def restored_from(self, manifest: dict) -> None:
        """Takes a checkpoint's position: the next fit continues from it."""
        self.epochs_done = manifest.get("epochs_done", 0)
        self.step_in_epoch = manifest.get("step_in_epoch", 0)
        self.resume_position = (self.step_in_epoch, manifest.get("input_position", 0))
        self.restored = True
        if manifest.get("shuffle_seed") is not None:
            self.shuffle_seed = int(manifest["shuffle_seed"])

    def take_resume(self) -> tuple[tuple[int, int], bool]:
        """((first step, input position), whether a checkpoint was restored) for the fit
        beginning now; both are consumed."""
        position, self.resume_position = self.resume_position, (0, 0)
        restored, self.restored = self.restored, False
        return position, restored

    def take_resume_metrics(self) -> dict | None:
        """`resume_metrics` for the fit beginning now (consumed)."""
        taken, self.resume_metrics = self.resume_metrics, None
        return taken

    def take_resume_input(self):
        """`resume_input` for the fit beginning now (consumed)."""
        taken, self.resume_input = self.resume_input, None
        return taken
