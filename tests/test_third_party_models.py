"""Models no one here wrote, trained in every mode a user switches on, against Keras.

`keras.applications` ResNet50 and MobileNetV3Small (BatchNorm frozen: in training mode
each replica would normalise with its own half-batch statistics, which is not the same
math as one device), KerasHub's BERT backbone (dict inputs, any sequence length) and a
model that went through `compile`. Each is trained on 2 devices under data parallelism,
ZeRO v1, ZeRO v2 with gradient checkpointing (parameters gathered segment by segment), and
an automatic 2-stage pipeline whose stages run with gradient checkpointing,
and must end where single-device Keras `fit` ends on the same batches (CELLS: which
model runs in which mode, and why).

What each mode adds for a given model: data parallelism runs the whole model on each
replica and all-reduces its gradients; ZeRO v1 runs the same forward and shards the
update instead; the pipeline cuts the model's graph in two, and gradient checkpointing
cuts each stage into recomputed segments. Checkpointing and the pipeline are the modes
that depend on the model's graph, and they run together, in one build and one trace with
a single replica, instead of in two cells of which the checkpointing one traced two
replicas. What checkpointing on 2 replicas adds, the all-reduce of recomputed gradients,
does not depend on the model: the compiled model's cell checks it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MODES = {
    "data_parallel": {},
    "zero_v1": {"zero.level": "v1"},
    "zero_v2+gradient_checkpointing": {"zero.level": "v2", "gradient_checkpoint.type": "auto"},
    "gradient_checkpointing": {"gradient_checkpoint.type": "auto"},
    "auto_pipeline+gradient_checkpointing": {
        "auto.auto_parallel": True,
        "pipeline.num_stages": 2,
        "gradient_checkpoint.type": "auto",
    },
}
CLASSES = 4


def _frozen_batchnorm(model):
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False  # Keras 3: inference-mode statistics
    return model


def resnet50(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=CLASSES, classifier_activation=None
    )
    return _frozen_batchnorm(model)


def mobilenet_v3_small(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.applications.MobileNetV3Small(
        weights=None,
        input_shape=(32, 32, 3),
        classes=CLASSES,
        dropout_rate=0.0,
        include_preprocessing=False,
    )
    return _frozen_batchnorm(model)


def hub_bert(seed=0):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=60,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
        dropout=0.0,
    )
    logits = keras.layers.Dense(CLASSES, name="classifier")(backbone.output["pooled_output"])
    return keras.Model(backbone.input, logits)


def compiled_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="dense_0")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="dense_1")(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))
    model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
    return model


def image_batches(seed=0, steps=2, batch=8):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(batch, 32, 32, 3)).astype("float32"), rng.integers(0, CLASSES, batch))
        for _ in range(steps)
    ]


def token_batches(seed=0, lengths=(6, 10)):
    rng = np.random.default_rng(seed)
    batches = []
    for length in lengths:
        ids = rng.integers(1, 60, size=(8, length)).astype("int32")
        mask = np.ones_like(ids)
        mask[:, -2:] = 0
        features = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
        batches.append((features, ids[:, 0] % CLASSES))
    return batches


def vector_batches(seed=0, steps=3):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 12)).astype("float32"), rng.integers(0, CLASSES, 8))
        for _ in range(steps)
    ]


def as_dataset(batches):
    first = batches[0][0]

    def spec(value):
        return tf.TensorSpec((None, *([None] * (value.ndim - 1))), tf.as_dtype(value.dtype))

    signature = (
        {k: spec(v) for k, v in first.items()} if isinstance(first, dict) else spec(first),
        tf.TensorSpec((None,), tf.int64),
    )
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=signature)


# model -> (builder, batches, optimizer, tolerance). ResNet50 uses SGD with momentum:
# several of its weights get gradients near 1e-9, whose sign the replicas' different
# summation order can flip, and Adam turns any such gradient into a full +-lr step
# (measured: 5e-4 apart after two Adam steps in every data-parallel mode, 0 in the
# one-replica pipeline). That is Adam's sensitivity, not the engine's math, which SGD shows.
MODELS = {
    "resnet50": (
        resnet50,
        image_batches,
        lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        1e-5,
    ),
    "mobilenet_v3_small": (
        mobilenet_v3_small,
        image_batches,
        lambda: keras.optimizers.Adam(1e-3),
        1e-5,
    ),
    "keras_hub_bert": (hub_bert, token_batches, lambda: keras.optimizers.Adam(1e-2), 1e-5),
    "compiled": (compiled_mlp, vector_batches, None, 1e-5),
}
# MobileNetV3Small has no data_parallel cell: in its two Adam steps only its classifier
# trains (71 of its 74 trainable weights move by less than 1e-5, its body's gradients being
# too small for Adam's epsilon), so that cell would check its whole-model forward on 2
# replicas and its softmax-output loss, which its zero_v1 cell checks with the same forward
# and loss, and an all-reduce of near-zero gradients, which ResNet50's data_parallel cell
# checks with gradients that move all 108 of ResNet50's trainable weights.
# KerasHub's BERT has no data_parallel cell either: test_keras_hub_tasks.py's
# bert_classifier-dp2 cell trains the same BertBackbone (2 layers, width 16) with a dense
# head on its pooled output, as BertTextClassifier is, on 2 replicas, against Keras's fit
# with SGD (a stricter check than Adam's here); ~35 s saved.
CELLS = [
    *[
        (name, "data_parallel")
        for name in MODELS
        if name not in ("mobilenet_v3_small", "keras_hub_bert")
    ],
    # ResNet50's zero_v1 cell is left to its zero_v2 cell, which reduce-scatters each
    # micro-batch's gradients into the same pieces (and gathers the parameters too).
    *[(name, "zero_v1") for name in MODELS if name != "resnet50"],
    ("compiled", "gradient_checkpointing"),  # recompute, then the all-reduce: see above
    # Parameters gathered per recomputed segment, again in its backward (zero_params.py):
    # depends on the model's graph, as checkpointing does.
    *[(name, "zero_v2+gradient_checkpointing") for name in MODELS if name != "mobilenet_v3_small"],
    *[(name, "auto_pipeline+gradient_checkpointing") for name in MODELS],
]
_references = {}


def _loss(name):
    # MobileNetV3Small keeps the applications' softmax classifier: Keras computes the
    # crossentropy from the logits the softmax output carries, and every mode must too.
    if name == "mobilenet_v3_small":
        return keras.losses.SparseCategoricalCrossentropy()
    return LOSS


def _reference_weights(name):
    if name not in _references:
        build, batches, optimizer, _ = MODELS[name]
        model = build()
        if optimizer is not None:
            model.compile(optimizer(), _loss(name))
        # Keras's own train_step, run eagerly: the same math as the traced one (weights
        # within 3e-7 of it, measured) without tracing a model the engine traces next.
        model.run_eagerly = True
        model.fit(as_dataset(batches()), verbose=0, shuffle=False)
        _references[name] = model.get_weights()
    return _references[name]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), CELLS, ids=[f"{n}-{m}" for n, m in CELLS])
def test_third_party_model_matches_keras(name, mode):
    build, batches, optimizer, tolerance = MODELS[name]
    model = build()
    config = {"cluster.virtual_devices": 2, **MODES[mode]}
    if optimizer is None:  # the compiled model brings its optimizer, loss and metrics
        trainer = epl.EPLTrainer(model, config=config)
    else:
        trainer = epl.EPLTrainer(model, _loss(name), optimizer(), config=config)
    history = trainer.fit(as_dataset(batches()), verbose=0)
    assert np.isfinite(history.history["loss"][0])
    if "auto_pipeline" in mode:
        assert trainer.plan.num_taskgraphs == 2
    else:
        assert trainer.plan.num_replicas == 2
    checkpointed = [0, 1] if "auto_pipeline" in mode else [0]
    if "gradient_checkpointing" in mode:  # every stage runs as recomputed segments
        assert sorted(trainer.engine.recomputed) == checkpointed
    expected = _reference_weights(name)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
    assert difference < tolerance, f"{name} under {mode}: max weight difference {difference}"
