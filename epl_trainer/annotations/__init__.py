"""The user-facing annotation API: what a user writes while building the model.

* `strategies`: `replicate` / `split` scopes, `set_default_strategy`, `Strategy`
  (stage and split maps as data), and their resolution into TaskGraph specs;
* `checkpoints`: `add_to_collection(x, "checkpoints")`, the marks of gradient
  checkpointing.

The engine (`epl_trainer.core`) never imports this package: the trainer reads the
annotations and hands the engine plain data (TaskGraph specs, node -> stage maps,
checkpoint marks).
"""
