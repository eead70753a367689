"""tf.data iterators released off the training thread.

Deleting a tf.data iterator waits for its autotuning thread's next wake-up, and that
thread sleeps for periods that double from 10 ms: it wakes 10, 30, 70, ..., 1270, 2550,
5110, 10230 ms (and so on) into the iterator's life. An epoch, an evaluation or a
prediction that ends between two wake-ups waits for the next one, up to as long again as
it ran (docs/benchmarks.md#deleting-tfdata-iterators).

`release(iterator)` hands the iterator to one daemon thread, which drops it once it holds
the last reference, so the wait happens there and the training thread goes on.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

_PENDING: queue.SimpleQueue = queue.SimpleQueue()
_WORKER: threading.Thread | None = None
_LOCK = threading.Lock()


def release(iterator) -> None:
    """Deletes `iterator` on the release thread once the caller has dropped its own
    references (None: nothing to do)."""
    global _WORKER
    if iterator is None:
        return
    with _LOCK:
        if _WORKER is None:
            _WORKER = threading.Thread(target=_drop_each, name="epl-iterator-release", daemon=True)
            _WORKER.start()
    _PENDING.put(iterator)


def _drop_each() -> None:
    while True:
        iterator = _PENDING.get()
        # The caller still holds the iterator for a moment after `release` (its local
        # name, its attribute): wait until this thread's is the last reference, so the
        # deletion runs here. getrefcount counts its own argument and this local.
        deadline = time.monotonic() + 10.0  # else someone keeps it: not ours to wait for
        while sys.getrefcount(iterator) > 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        del iterator
