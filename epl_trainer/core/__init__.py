"""The engine, in layers (each imports only itself and the layers listed before it):

* `plan`: Plan, planner, schedules, estimates, combination rules (no TensorFlow);
* `comm`: TensorFlow's collectives: keys and ordering, groups, fused buckets, lanes;
* `graph`: cutting and costing the Keras graph;
* `engine`: state, the tf.function steps and the passes (the trainer's entry point).

docs/architecture.md describes the data flow.
"""
