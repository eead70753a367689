"""Asynchronous checkpoint saves (`checkpoint.async_save`): one background writer thread.

The step hands the writer a snapshot of the state and goes on. The snapshot costs no copy
at the time it is taken on CPU: a TensorFlow tensor read from a variable shares the
variable's buffer, and an update of that variable while the read is alive copies it first
(resource variables copy on write).
The writer writes the snapshot's whole pages straight from its memory (shard_file.py).
Values on an accelerator are copied to host memory when the snapshot is taken.

At most one save is in flight: the caller joins the one before. The memory a save holds is
therefore one snapshot of this worker's state, until its shard is written, plus a few
staging pages (kept by `CheckpointManager`).

What the background thread runs is the caller's (`CheckpointManager`): writing this
worker's shard and syncing it to storage, and in a single-worker job publishing it (the
manifest, the folder moved into place, then `latest`). A multi-worker job agrees that
every shard is written on the main thread, where every worker meets in the same order, at
the next save, a restore, or the end of `fit`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Fault injection for tests: called on the writer thread before it writes (a test holds
# the write back here while training goes on).
before_write: Callable[[int], None] | None = None


@dataclasses.dataclass
class SaveInFlight:
    """One asynchronous save.

    Attributes:
      step: the step it saves.
      folder: the temporary folder it writes into.
      path: where it is published (the chief's; None on other workers).
      error: why it failed (set by the writer thread), or None.
      publish: the chief's publication (the manifest, the folder moved into place, then
        `latest`); returns the published path.
      published: whether `latest` names it yet (a multi-worker job publishes on the main
        thread once every worker has written).
    """

    step: int
    folder: str
    path: str | None
    publish: Callable[[], str]
    error: BaseException | None = None
    published: bool = False


class BackgroundWriter:
    """Runs one save at a time on a background thread (not a daemon: the interpreter's exit
    waits for it, so a process that returns from `fit` never leaves a half-written save)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._save: SaveInFlight | None = None

    def submit(self, save: SaveInFlight, write: Callable[[], None]) -> None:
        """Starts `write()` for `save` on the writer thread. The caller has joined the
        previous save (one in flight at most)."""
        if self._save is not None:
            raise RuntimeError(
                f"A save of step {self._save.step} is still in flight; join it before "
                f"submitting step {save.step}."
            )

        def run():
            try:
                if before_write is not None:
                    before_write(save.step)
                write()
            except BaseException as error:
                save.error = error
                logger.error(
                    "The asynchronous save of step %d into %r failed: %s",
                    save.step,
                    save.folder,
                    error,
                )

        self._save = save
        self._thread = threading.Thread(
            target=run, name=f"epl-checkpoint-writer-{save.step}", daemon=False
        )
        self._thread.start()

    def join(self) -> SaveInFlight | None:
        """Waits for the save in flight; returns it (its `error` set if it failed), or None
        when there is none."""
        save, thread = self._save, self._thread
        if thread is not None:
            thread.join()
        self._save, self._thread = None, None
        return save
