"""Keras layers with distributed implementations in the engine (`epl.layers.MoE`)."""

from epl_trainer.layers.moe import MoE, Routing

__all__ = ["MoE", "Routing"]
