"""Memory features: grouped apply, CPU offload, memory_report (ZeRO, AMP and gradient
checkpointing have their own files)."""

import keras
import pytest
from _models import (
    adam_trainer,
    keras_reference,
    max_weight_difference,
    mlp,
    mlp_data,
)

from epl_trainer.core.engine.state import variable_bytes

ATOL = 1e-5


@pytest.mark.parametrize("groups", [1, 3, 8])
def test_grouped_apply_matches_keras(groups):
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    model = mlp()
    trainer = adam_trainer(model, 2, **{"optimizer.num_apply_group": groups})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    update = trainer.engine.program.update
    assert len(update.groups[0]) == min(groups, len(model.trainable_variables))
    assert max_weight_difference(reference, model) < ATOL
    # Each group's optimizer counts the steps once, as one optimizer would.
    assert all(int(o.iterations.numpy()) == 3 for o in update.optimizers[0][0])


def test_grouped_apply_chains_groups_with_control_dependencies():
    import tensorflow as tf

    x, y = mlp_data()
    trainer = adam_trainer(mlp(), 1, **{"optimizer.num_apply_group": 2})
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    trainer.fit(dataset, steps_per_epoch=1, verbose=0)
    graph = trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph
    _, second = trainer.engine.program.update.groups[0]
    second_names = {trainer.engine.state.trainable[0][i].path.split("/")[0] for i in second}
    # Some op of the second group's update waits (control input) on the first group.
    waits = [
        op
        for op in graph.get_operations()
        if op.control_inputs and any("ReadVariableOp" in c.type for c in op.control_inputs)
    ]
    assert waits and second_names


@pytest.mark.combines("offload+data_parallel")
def test_offload_matches_keras_and_keeps_parameters_on_the_host():
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    model = mlp()
    trainer = adam_trainer(model, 4, **{"offload.level": "v0"})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL

    report = trainer.memory_report(print_table=False)
    host = trainer.cluster.host_device
    param_bytes = sum(variable_bytes(v) for v in model.weights)
    devices = [lane.devices[0] for lane in trainer.lanes]
    # One shared copy on the host (which, with simulated devices, is also CPU:0) ...
    assert report[host].parameters == pytest.approx(param_bytes, rel=0.01)
    # ... and none on the other compute devices: they receive each weight when they use it.
    for device in devices:
        if device != host:
            assert report[device].parameters == 0 and report[device].optimizer == 0


def test_memory_report_of_plain_data_parallelism_counts_every_replica():
    x, y = mlp_data()
    model = mlp()
    trainer = adam_trainer(model, 4)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False)
    report = trainer.memory_report(print_table=False)
    params = sum(variable_bytes(v) for v in model.trainable_variables)
    for lane in trainer.lanes:
        row = report[lane.devices[0]]
        assert row.parameters >= params and row.gradients == params
        assert row.optimizer >= 2 * params  # Adam: two slots per weight
    assert "parameters" in str(report)


@pytest.mark.combines("checkpoint+zero_v1+data_parallel")
def test_zero_checkpoint_restores_every_shard(tmp_path):
    x, y = mlp_data()
    uninterrupted = mlp()
    adam_trainer(uninterrupted, 4, **{"zero.level": "v1"}).fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
    )
    first = adam_trainer(mlp(), 4, **{"zero.level": "v1"})
    first.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    first.save_checkpoint(str(tmp_path))
    resumed_model = mlp(seed=7)
    resumed = adam_trainer(resumed_model, 4, **{"zero.level": "v1"})
    resumed.restore_checkpoint(str(tmp_path))
    resumed.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert max_weight_difference(uninterrupted, resumed_model) < 1e-6
