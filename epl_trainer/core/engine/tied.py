"""Which layouts hold a tied weight (a trainable weight several pipeline stages use).

Each stage using the weight holds its own copy; the lane adds the stages' gradients and
the owner's update is copied to the others (state.py). That needs every stage of a lane
in this process and the weight whole in every copy, so these are refused, by name:

* ZeRO (`zero.level`): the owner's gradient and optimizer state would be sharded over
  the lanes while the stage copies stay whole;
* offload (`offload.level`): the host copy is one variable shared by every stage;
* split layers: a split weight is sharded over the replica's lanes;
* a replica whose stages are on several workers: its copies would be summed and
  updated on different processes (data parallelism between workers, each holding
  whole replicas, is supported).
"""

from __future__ import annotations

from epl_trainer.core.plan import rules


def check_tied_weights(state, config, split_layers, spans_workers: bool) -> None:
    """Raises ValueError if a tied weight meets a feature it is not combined with
    (`rules.REFUSALS["tied_weights"]`)."""
    if not state.tied:
        return
    names = ", ".join(
        f"{state.model_trainable[i].path!r} (stages {', '.join(map(str, used))})"
        for i, used in state.tied.items()
    )
    rules.check_tied_weights(names, config, bool(split_layers), spans_workers)
