"""Cutting and costing the Keras graph.

* `partition`: a functional model -> one sub-model per stage (boundary tensors routed
  by key, skip connections across stages);
* `cost`: per-node parameters, FLOPs and activation bytes, from shapes;
* `auto_partition`: repeated-block detection and balanced contiguous stage cuts;
* `segments`: where gradient checkpointing cuts a stage;
* `flops`, `flops_profile`: FLOPs of a traced training step, op by op, per layer and
  stage, and the profile table; `peak`: the machine's matmul peak (MFU's denominator).
"""
