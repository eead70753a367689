"""Tensor split (`epl.split`): layers whose weights are sharded over the lanes of a replica
(`layers`: the sharded layers and their loss; `lanes`: the pass that plugs them into the
step's hooks)."""

from epl_trainer.core.engine.surface import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(
    __name__,
    {
        "apply_split": "lanes",
        "check_split_metrics": "layers",
        "computed_blocks": "layers",
        "find_computed_blocks": "decoder_blocks",
        "find_split_layers": "layers",
        "gather_whole": "layers",
        "gathered_variables": "layers",
        "laid_out_pairs": "layers",
        "megatron_pairs": "layers",
        "sparse_outputs": "layers",
        "staged_megatron_pairs": "layers",
        "vocabulary_parallel": "layers",
    },
)
