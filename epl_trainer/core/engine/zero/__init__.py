"""ZeRO: optimizer state (v0), gradients (v1) and parameters (v2) sharded over a stage
group (`update`: the pass; `layout`: which elements each shard owns; `exchange`: the
collectives on the pieces; `params`: v2's parameters held as pieces; `gather`: v2 with a
stage group across workers)."""

from epl_trainer.core.engine.surface import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(
    __name__,
    {
        "ZeroUpdate": "update",
        "splits_variables": "layout",
        "StageGather": "gather",
        "eager_reads": "gather",
        "is_gathered": "params",
        "SegmentGathers": "params",
    },
)
