"""The update half of a step: gradient reduction and clipping (`reduce`), the replicated
update (`update`), the optimizer apply, XLA-compiled where it pays (`apply`), which
variable each optimizer slot belongs to (`slots`), and the user's optimizer holding the
engine's optimizer state (`master_state`)."""

from epl_trainer.core.engine.surface import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(
    __name__,
    {
        "GradientReduction": "reduce",
        "clipped_by": "reduce",
        "scaled": "reduce",
        "sum_of_squares": "reduce",
        "sum_over_lane": "reduce",
        "ReplicatedUpdate": "update",
        "balanced_groups": "update",
        "written": "update",
        "OptimizerStep": "apply",
        "MasterState": "master_state",
        "build_master": "master_state",
        "factored_attribute": "slots",
        "is_factored": "slots",
        "slot_shape": "slots",
        "slots_of": "slots",
        "unrecorded_state": "slots",
        "recording_class": "slots",
    },
)
