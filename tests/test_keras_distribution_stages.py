"""Keras's layout maps with pipeline stages (issue 47: stages stay a third dimension).

A `ModelParallel` whose layout map shards variables, combined with pipeline stages (a
stage map, `epl.replicate` stage scopes, or `auto.auto_parallel` with
`pipeline.num_stages`), trains on batch x model x stages devices: the mesh's devices run
stage 0 and each later stage takes the next group of the worker's devices, laid out as
the mesh; lane j of a replica holds device j of every stage. A stage's sharded variables
are held in blocks on its own devices, its split layers' collectives run among them, and
activations pass between a lane's stages as in any pipeline. Each run ends where plain
Keras `fit` on one device ends (SGD within 1e-6); before, every such run was refused
("... is not combined with pipeline stages in this version").
"""

import keras
import pytest
from _models import LOSS, max_weight_difference, mlp_data
from test_keras_distribution import (
    ATOL,
    ATOL_ADAM,
    BATCH,
    LM_LOSS,
    OPTIMIZERS,
    STEPS,
    _causal_lm,
    _causal_lm_data,
    _causal_lm_reference,
    _devices,
    _difference_from,
    _fit,
    _mesh,
    _mlp_pair,
    _pair_layouts,
    _pair_reference,
)

import epl_trainer as epl

PIPELINE = {"pipeline.num_micro_batch": 2, "pipeline.strategy": "PreferBackward"}  # 1F1B


@pytest.fixture(autouse=True)
def _no_global_distribution():
    yield
    keras.distribution.set_distribution(None)


def _short(device: str) -> str:
    return device.rsplit("/device:", 1)[1]


def _layout_map():
    """up -> down a Megatron pair over 'model', logits' kernel laid out by row (gathered
    on use)."""
    layout_map = _pair_layouts(_mesh((1, 2)))
    layout_map["logits/kernel"] = ("model", None)
    return layout_map


def _scoped_mlp_pair():
    """`_mlp_pair` built in `epl.replicate` stage scopes: up and down, then logits."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="x")
    with epl.replicate(1, name="stage_0"):
        h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
        h = keras.layers.Dense(8, activation="tanh", name="down")(h)
    with epl.replicate(1, name="stage_1"):
        outputs = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inputs, outputs)


# Bytes each device holds: the pair inside stage 0 computes sharded (half of up's kernel
# and bias and of down's kernel, down's bias whole), logits' kernel is halved on stage 1;
# a boundary between up and down cuts the pair, whose laid-out variables are then held
# halved and gathered on use (up on stage 0; down's kernel halved, its bias whole, and
# logits on stage 1).
TOGETHER = {0: (48 + 8 + 64 + 8) * 4, 1: (12 + 3) * 4}
CUT = {0: (48 + 8) * 4, 1: (64 + 8 + 12 + 3) * 4}


@pytest.mark.parametrize(
    "annotation, optimizer, held",
    [
        ("stage_map", "sgd", TOGETHER),
        ("stage_map", "adam", TOGETHER),
        ("scopes", "sgd", TOGETHER),
        ("cut_pair", "sgd", CUT),
        ("cut_pair", "adam", CUT),
    ],
)
def test_a_layout_map_trains_in_pipeline_stages_as_keras(annotation, optimizer, held):
    """A (1, 2) mesh cut in 2 stages: 4 devices, 2 micro-batches, 1F1B."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference(optimizer)  # Keras on x, y
    model = _scoped_mlp_pair() if annotation == "scopes" else _mlp_pair()
    stages = {
        "stage_map": {"up|down": 0, "logits": 1},
        "scopes": None,
        "cut_pair": {"up": 0, "down|logits": 1},
    }[annotation]
    strategy = keras.distribution.ModelParallel(layout_map=_layout_map())
    trainer = epl.EPLTrainer(
        model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy, stages=stages, config=PIPELINE
    )
    plan = trainer.plan
    assert [(tg.kind, tg.device_count) for tg in plan.taskgraphs] == [("replicate", 2)] * 2
    assert (plan.num_replicas, plan.num_micro_batch) == (1, 2)
    # Lane j holds device j of every stage: the mesh's devices run stage 0.
    lanes = [tuple(_short(d) for d in lane.devices) for lane in trainer.lanes]
    assert lanes == [("CPU:0", "CPU:2"), ("CPU:1", "CPU:3")]
    described = plan.layouts_description
    assert "; 2 pipeline stages, each on its own 2 devices" in described
    cut = "; Megatron pairs cut by a stage boundary, gathered on use: up, down"
    assert (cut in described) == (annotation == "cut_pair")
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)
    placement = {_short(d): size for d, size in trainer.placement().items()}
    assert placement == {"CPU:0": held[0], "CPU:1": held[0], "CPU:2": held[1], "CPU:3": held[1]}


def test_kerashub_llama_with_its_layout_map_trains_in_two_pipeline_stages_as_keras():
    """Llama with `LlamaBackbone.get_layout_map` on (1, 2), cut in 2 stages by the stage
    map (the backbone, then the logits of its `ReversibleEmbedding`), 2 micro-batches:
    the backbone's blocks compute sharded among stage 0's devices, each holding its
    blocks only; stage 1's devices hold the (replicated) reverse embedding only. The
    reverse call reads only `reverse_embeddings`, so neither table is a tied weight of
    both stages (before, both were, and tied weights are not held in blocks)."""
    keras_hub = pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    reference = _causal_lm_reference("llama", optimizer="sgd")
    model = _causal_lm("llama")
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(_mesh((1, 2)))
    trainer = epl.EPLTrainer(
        model,
        LM_LOSS,
        OPTIMIZERS["sgd"](),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
        stages={".*backbone.*": 0, "token_embedding": 1},
        config=PIPELINE,
    )
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < ATOL
    # 21,824 bytes a device on (1, 2) without stages: the reverse embedding's 4,096
    # (16 x 64 floats) move to stage 1's devices.
    placement = {_short(d): size for d, size in trainer.placement().items()}
    assert placement == {"CPU:0": 17_728, "CPU:1": 17_728, "CPU:2": 4_096, "CPU:3": 4_096}


def test_kerashub_llama_in_an_automatic_pipeline_over_its_layout_map_trains_as_keras():
    """The same with `auto.auto_parallel` and `pipeline.num_stages=2`, Adam."""
    keras_hub = pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    reference = _causal_lm_reference("llama", optimizer="adam")
    model = _causal_lm("llama")
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(_mesh((1, 2)))
    trainer = epl.EPLTrainer(
        model,
        LM_LOSS,
        OPTIMIZERS["adam"](),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
        config={**PIPELINE, "auto.auto_parallel": True, "pipeline.num_stages": 2},
    )
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < ATOL_ADAM
    assert set(trainer.placement().values()) == {17_728, 4_096}


def test_a_checkpoint_of_stages_over_a_layout_map_restores_into_data_parallelism(tmp_path):
    """Adam, 2 steps in 2 stages over the (1, 2) mesh, saved (blocks and their Adam
    slots joined); restored into 2-device data parallelism, 2 more steps: where 4
    uninterrupted Keras steps end."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference("adam")  # Keras on x, y
    first = epl.EPLTrainer(
        _mlp_pair(),
        LOSS,
        OPTIMIZERS["adam"](),
        strategy=keras.distribution.ModelParallel(layout_map=_layout_map()),
        stages={"up|down": 0, "logits": 1},
        config=PIPELINE,
    )
    half = BATCH * STEPS // 2
    first.fit(x[:half], y[:half], batch_size=BATCH, shuffle=False, verbose=0)
    first.save_checkpoint(str(tmp_path))
    model = _mlp_pair()
    second = epl.EPLTrainer(
        model,
        LOSS,
        OPTIMIZERS["adam"](),
        strategy=keras.distribution.DataParallel(devices=_devices(2)),
    )
    second.restore_checkpoint(str(tmp_path))
    # The checkpoint holds one epoch done: the second fit's epochs=2 runs one more.
    second.fit(x[half:], y[half:], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < ATOL_ADAM


def test_what_stages_over_a_layout_map_do_not_train_is_named():
    """batch x model x stages devices must exist; interleaved schedules, ZeRO, AMP and
    global-norm clipping are not combined with stages over a sharding map."""
    layout_map = _pair_layouts(_mesh((2, 2)))
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    stages = {"up": 0, "down": 1, "logits": 2}
    with pytest.raises(
        ValueError,
        match=r"trains on batch x model x stages = 2 x 2 x 3 = 12 devices.*of which it has 4 "
        r"besides the mesh's \(8 in all\)",
    ):
        epl.EPLTrainer(_mlp_pair(), LOSS, "sgd", strategy=strategy, stages=stages)
    strategy = keras.distribution.ModelParallel(layout_map=_layout_map())
    stages = {"up|down": 0, "logits": 1}
    for config, optimizer, received in [
        ({"zero.level": "v1"}, "sgd", "'zero.level': 'v1'"),
        ({"amp.level": "O1"}, "sgd", "'amp.level': 'O1'"),
        ({}, keras.optimizers.SGD(0.1, global_clipnorm=1.0), "'global_clipnorm': 1.0"),
    ]:
        with pytest.raises(
            ValueError, match=f"Pipeline stages over a Keras layout map.*{received}"
        ):
            epl.EPLTrainer(
                _mlp_pair(), LOSS, optimizer, strategy=strategy, stages=stages, config=config
            )
    interleaved = {"pipeline.strategy": "Interleaved1F1B", "pipeline.virtual_stages": 2}
    with pytest.raises(ValueError, match=r"'pipeline.virtual_stages': 2"):
        epl.EPLTrainer(
            _mlp_pair(), LOSS, "sgd", strategy=strategy, stages=stages, config=interleaved
        )
