"""The public names users import from epl_trainer."""

import epl_trainer as epl


def test_error_classes_are_exported():
    from epl_trainer.core.plan.ir import SplitError
    from epl_trainer.training.checkpoint import CheckpointError

    assert epl.CheckpointError is CheckpointError and epl.SplitError is SplitError
    for name in ("WorkerLostError", "NonFiniteLossError", "ConfigError", "PlanError"):
        assert issubclass(getattr(epl, name), Exception)
