"""Cutting and costing the Keras graph.

* `partition`: a functional model -> one sub-model per stage (boundary tensors routed
  by key, skip connections across stages);
* `cost`: per-node parameters, FLOPs and activation bytes, from shapes;
* `auto_partition`: repeated-block detection and balanced contiguous stage cuts;
* `segments`: where gradient checkpointing cuts a stage.
"""
