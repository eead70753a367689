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


def check_tied_weights(state, config, split_layers, spans_workers: bool) -> None:
    """Raises ValueError if a tied weight meets a feature it is not combined with."""
    if not state.tied:
        return
    names = ", ".join(
        f"{state.model_trainable[i].path!r} (stages {', '.join(map(str, used))})"
        for i, used in state.tied.items()
    )
    refused = []
    if config.zero.level:
        refused.append(f"zero.level={config.zero.level!r}")
    if config.offload.level:
        refused.append(f"offload.level={config.offload.level!r}")
    if split_layers:
        refused.append("split layers")
    if spans_workers:
        refused.append("a replica's stages on several workers")
    if refused:
        raise ValueError(
            f"Weight(s) {names} are used by several pipeline stages (tied weights): each "
            "of those stages holds a copy, summed and updated together in one process, "
            f"which is not combined with {' and '.join(refused)} yet. Cut the model so "
            "one stage uses the weight (a manual stage map or pipeline.num_stages=1 with "
            "data parallelism), or train without those options."
        )
