"""A weight used by two pipeline stages (tied input and output embeddings), Megatron-style.

The token embedding is used on the tokens in the first stage and again for the logits
in the last: a `keras_hub.layers.ReversibleEmbedding` called a second time, reversed
(the automatic cut), or a second layer reading its matrix (the stage map, which assigns
layers by name). Each stage holds its own copy; the lane adds the two stages' gradients
before clipping and the optimizer, and the owner's update is copied to the other stage
(epl_trainer/core/engine/state.py). Weights after 3 steps (2 micro-batches) must equal
plain Keras `fit` on one device to 1e-5 (measured: <= 9e-8).

Before: the manual stage map failed in partition_model ("Weight 'embed/embeddings' is
used by stage 0 and stage 1"), the automatic cut refused every cut point between the
two calls ("Cannot cut 2 stages ... users of a shared weight").
"""

import keras
import numpy as np
import pytest
from _models import LOSS, TiedLogits, keras_reference, max_weight_difference

import epl_trainer as epl

keras_hub = pytest.importorskip("keras_hub")

ATOL = 1e-5
VOCABULARY, WIDTH, LENGTH = 13, 8, 5
# The stage map names layers (every call of a layer goes to its stage), so it ties the
# weight through a second layer object; the automatic cut gets ReversibleEmbedding's two
# calls of one layer.
STAGES = {"embed|block_0": 0, "block_1|norm|logits": 1}


def tied_model(reverse_call=True, seed=3):
    """Tokens -> embedding -> 2 Dense blocks -> logits from the same embedding matrix."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    embed = keras_hub.layers.ReversibleEmbedding(VOCABULARY, WIDTH, name="embed")
    h = embed(tokens)
    h = keras.layers.Dense(WIDTH, activation="tanh", name="block_0")(h)
    h = keras.layers.Dense(WIDTH, activation="tanh", name="block_1")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    logits = embed(h, reverse=True) if reverse_call else TiedLogits(embed, name="logits")(h)
    return keras.Model(tokens, logits)


def tied_data(n=48, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCABULARY, size=(n, LENGTH)).astype("int32")
    return x, rng.integers(0, VOCABULARY, size=(n, LENGTH)).astype("int32")


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.02),
    # The global norm counts the tied weight's gradient once, summed over its two uses.
    "sgd_clipped": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
}


def reference(layout, optimizer):
    x, y = tied_data()
    model = tied_model(reverse_call=layout == "auto")
    keras_reference(model, x, y, OPTIMIZERS[optimizer](), batch_size=16, steps=3)
    return model


def trainer_of(model, layout, optimizer, devices=2, **config):
    config = {"cluster.virtual_devices": devices, "pipeline.num_micro_batch": 2, **config}
    stages = None
    if layout == "auto":
        config.update({"auto.auto_parallel": True, "pipeline.num_stages": 2})
    else:
        stages = STAGES
    return epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), stages=stages, config=config)


def train(layout, optimizer, devices=2, **config):
    x, y = tied_data()
    model = tied_model(reverse_call=layout == "auto")
    trainer = trainer_of(model, layout, optimizer, devices, **config)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    return model, trainer


# Passes that change how a stage runs or is updated, with a tied weight.
PASSES = {
    "recompute": {"gradient_checkpoint.type": "auto"},
    "grouped_apply": {"optimizer.num_apply_group": 2},
    "1f1b": {"pipeline.strategy": "PreferBackward", "pipeline.num_micro_batch": 4},
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.combines("tied_weights+gradient_checkpoint+pipeline"))
        if name == "recompute"
        else name
        for name in sorted(PASSES)
    ],
)
@pytest.mark.combines("tied_weights+pipeline")
def test_tied_embedding_with_other_passes_matches_keras(name):
    model, trainer = train("auto", "adam", 2, **PASSES[name])
    if name == "recompute":
        assert trainer.engine.recomputed, "a stage is recomputed"
    difference = max_weight_difference(model, reference("auto", "adam"))
    print(f"{name}: max weight difference {difference:.2e}")
    assert difference < ATOL
    stage_copies_agree(trainer)


def stage_copies_agree(trainer):
    """Every stage copy equals its owner, in every lane."""
    state = trainer.engine.state
    assert state.tied, "the embedding is used by both stages"
    for li, copies in enumerate(state.stage_copies):
        assert copies
        for (i, _), copy in copies.items():
            np.testing.assert_array_equal(copy.numpy(), state.trainable[li][i].numpy())


CASES = [
    ("manual", "sgd", 2),
    ("auto", "sgd", 2),
    ("auto", "adam", 2),
    ("auto", "sgd_clipped", 2),
    pytest.param(  # 2 data-parallel replicas of the 2-stage pipeline
        "manual", "adam", 4, marks=pytest.mark.combines("tied_weights+pipeline+data_parallel")
    ),
]


@pytest.mark.parametrize(("layout", "optimizer", "devices"), CASES)
@pytest.mark.combines("tied_weights+pipeline")
def test_tied_embedding_in_two_stages_matches_keras(layout, optimizer, devices):
    model, trainer = train(layout, optimizer, devices)
    assert trainer.plan.num_taskgraphs == 2
    assert trainer.plan.num_replicas == devices // 2
    stage_names = [set(stage.layer_names) for stage in trainer.engine.staged.stages]
    assert "embed" in stage_names[0] and ({"embed", "logits"} & stage_names[1])
    difference = max_weight_difference(model, reference(layout, optimizer))
    print(f"{layout} {optimizer} {devices} devices: max weight difference {difference:.2e}")
    assert difference < ATOL
    stage_copies_agree(trainer)


def test_the_tied_weight_moves_in_the_reference():
    """The comparison above is not vacuous: Keras's 3 steps move the tied embedding far
    beyond the tolerance."""
    initial = tied_model().get_weights()[0]
    trained = reference("auto", "sgd").get_weights()[0]
    assert float(np.abs(trained - initial).max()) > 1e-2


@pytest.mark.combines("checkpoint+tied_weights+pipeline")
def test_checkpoint_round_trip_under_the_pipeline(tmp_path):
    """Saved once (its owner's copy), restored into both stages' copies of a fresh
    trainer: training on from there ends where an uninterrupted run ends."""
    x, y = tied_data()
    uninterrupted = tied_model()
    trainer_of(uninterrupted, "auto", "adam").fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
    )
    first = trainer_of(tied_model(), "auto", "adam")
    first.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    first.save_checkpoint(str(tmp_path))
    saved = first.engine.state.model_trainable
    resumed_model = tied_model(seed=11)  # different weights: all must come from the checkpoint
    resumed = trainer_of(resumed_model, "auto", "adam")
    resumed.restore_checkpoint(str(tmp_path))
    stage_copies_agree(resumed)
    assert (
        max(
            float(np.abs(a.numpy() - b.numpy()).max())
            for a, b in zip(saved, resumed.engine.state.model_trainable)
        )
        == 0.0
    )
    assert resumed.epochs_done == 1
    resumed.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)  # the second epoch
    assert max_weight_difference(uninterrupted, resumed_model) == 0.0
    stage_copies_agree(resumed)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"zero.level": "v2"}, "zero.level='v2'"),
        ({"offload.level": "v0"}, "offload.level='v0'"),
    ],
)
def test_unsupported_combinations_name_the_tied_weight(config, named):
    x, y = tied_data(16)
    trainer = trainer_of(tied_model(), "auto", "sgd", **config)
    with pytest.raises(
        ValueError,
        match=rf"not combined with ZeRO, offload.* Received: tied weight\(s\) "
        rf"'embed/embeddings' \(stages 0, 1\) with {named}",
    ):
        trainer.fit(x, y, batch_size=16, verbose=0)  # the engine is built for its first step
