"""Planning, without TensorFlow: everything `epl-plan` needs.

* `ir`: TaskGraph, Device, Plan, StrategySpec: plain data;
* `planner`: (TaskGraph requests, cluster devices, micro-batches) -> Plan;
* `rules`: which settings combine, checked once on the config and the plan;
* `schedule`: pipeline schedules (GPipe, 1F1B) as data, simulated in unit steps;
* `estimate`, `analytic`: per-device memory, bubble and traffic of a plan, by arithmetic.

Nothing here imports TensorFlow or Keras, even indirectly (tests/test_architecture.py).
"""
