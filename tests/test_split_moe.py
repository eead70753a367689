"""Expert parallelism: a split MoE (experts sharded, tokens moved by all-to-all) equals
the unsplit layer.

The unsplit reference routes the whole batch as `n` contiguous groups, which is what n
lanes with one group each do (see `epl_trainer.layers.MoE`). Tolerance: weights after
3 SGD steps within 1e-5 of single-device Keras; loss (which includes the auxiliary
load-balancing loss) and predictions within 1e-5.
"""

import keras
import numpy as np
import pytest
from _models import LOSS, keras_reference, max_weight_difference

import epl_trainer as epl
from epl_trainer.layers import MoE

ATOL = 1e-5
SEQ, DIM, CLASSES = 4, 8, 3


def moe_model(num_groups, top_k=2, num_experts=4, capacity_factor=1.0, seed=3, width=None):
    keras.utils.set_random_seed(seed)
    # EPL's MoE recipe: everything replicated (on the split's devices when colocated)
    # except the experts.
    epl.set_default_strategy(epl.replicate())
    tokens = keras.Input((SEQ, DIM), name="tokens")
    h = keras.layers.Dense(DIM, activation="tanh", name="proj")(tokens)
    with epl.split(width):
        moe = MoE(
            num_experts,
            16,
            top_k=top_k,
            capacity_factor=capacity_factor,
            min_capacity=1,
            aux_loss_coef=0.1,
            num_groups=num_groups,
            name="moe",
        )(h)
    h = keras.layers.Add(name="residual")([h, moe])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(CLASSES, name="logits")(h)
    return keras.Model(tokens, out)


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, SEQ, DIM)).astype("float32")
    return x, rng.integers(0, CLASSES, n).astype("int32")


def split_trainer(model, devices, optimizer=None, **config):
    config = {
        "cluster.virtual_devices": devices,
        "cluster.colocate_split_and_replicate": True,
        **config,
    }
    return epl.EPLTrainer(model, LOSS, optimizer or keras.optimizers.SGD(0.1), config=config)


# Each lane count and each top_k once. Trimmed for the suite's time: top-2 on 2 lanes
# (test_dropped_tokens_still_match_with_a_tight_capacity trains it, and
# test_replicas_and_micro_batches_route_one_group_each 2 lanes x 2 micro-batches) and
# top-1 on 4 lanes (top-1's routing is the 2-lane cell's, 4 lanes' all-to-all the top-2
# cell's).
@pytest.mark.parametrize(("devices", "top_k"), [(2, 1), (4, 2)])
def test_split_moe_trains_like_the_unsplit_layer(devices, top_k):
    epl.init()  # fresh annotations for each model
    x, y = data()
    reference = moe_model(num_groups=devices, top_k=top_k)
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    expected_loss = float(LOSS(y[:16], reference(x[:16])) + sum(reference.losses))

    epl.init()
    model = moe_model(num_groups=1, top_k=top_k)
    trainer = split_trainer(model, devices)
    assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL

    # Forward after training: loss with the auxiliary loss, and predictions.
    got = trainer.evaluate(x[:16], y[:16], batch_size=16, return_dict=True)["loss"]
    assert got == pytest.approx(expected_loss, abs=ATOL)
    np.testing.assert_allclose(
        trainer.predict(x[:16], batch_size=16), reference.predict(x[:16], verbose=0), atol=ATOL
    )


@pytest.mark.parametrize(
    "devices, width, config, groups",
    [
        (4, 2, {}, 4),  # 2 replicas x 2 lanes
        (2, None, {"pipeline.num_micro_batch": 2}, 4),  # 2 lanes x 2 micro-batches
        (4, 2, {"pipeline.num_micro_batch": 2, "zero.level": "v2"}, 8),
    ],
)
def test_replicas_and_micro_batches_route_one_group_each(devices, width, config, groups):
    """Each replica's lane routes each micro-batch as the layer's num_groups groups: the
    step equals Keras routing the global batch as replicas x lanes x micro-batches
    contiguous groups. Adam (3 steps), a capacity that drops tokens, top-2."""
    epl.init()
    x, y = data()
    reference = moe_model(num_groups=groups, capacity_factor=0.5)
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    epl.init()
    model = moe_model(num_groups=1, capacity_factor=0.5, width=width)
    trainer = split_trainer(model, devices, keras.optimizers.Adam(0.01), **config)
    assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_each_lane_holds_its_experts_only():
    epl.init()
    model = moe_model(num_groups=1, num_experts=8)
    trainer = split_trainer(model, 4)
    x, y = data()
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    state = trainer.engine.state
    layer = model.get_layer("moe")
    for variable in (layer.w_in, layer.b_in, layer.w_out, layer.b_out):
        index = next(i for i, v in enumerate(state.model_trainable) if v is variable)
        shapes = {tuple(state.trainable[li][index].shape) for li in range(4)}
        assert shapes == {(2, *variable.shape[1:])}
        joined = np.concatenate([np.asarray(state.trainable[li][index].value) for li in range(4)])
        np.testing.assert_array_equal(joined, np.asarray(variable.value))
    gate = next(i for i, v in enumerate(state.model_trainable) if v is layer.gate_kernel)
    assert tuple(state.trainable[3][gate].shape) == tuple(layer.gate_kernel.shape)  # replicated


def test_dropped_tokens_still_match_with_a_tight_capacity():
    """capacity_factor 0.5 drops tokens in every group; each lane drops the same ones as
    the unsplit layer's corresponding group."""
    epl.init()
    x, y = data()
    reference = moe_model(num_groups=2, capacity_factor=0.5)
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=2)
    epl.init()
    model = moe_model(num_groups=1, capacity_factor=0.5)
    split_trainer(model, 2).fit(
        x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False
    )
    assert max_weight_difference(reference, model) < ATOL


def test_experts_that_do_not_split_evenly_are_refused():
    epl.init()
    model = moe_model(num_groups=1, num_experts=6)
    with pytest.raises(ValueError, match="num_experts=6"):
        split_trainer(model, 4)
