"""The user's Keras model checked and built as Keras's own `fit` would: refused under
another distribution strategy, built from the first data when it is not built yet."""

from __future__ import annotations

import logging

import keras
import tensorflow as tf
from keras import tree

logger = logging.getLogger(__name__)


def check_no_distribution_strategy(model) -> None:
    """EPLTrainer places the model's copies itself: inside a `tf.distribute` strategy's
    scope (or on a model whose variables one mirrors) both would distribute it."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if strategy is None and isinstance(model, keras.Model):
        for variable in model.variables[:1]:
            if isinstance(getattr(variable, "value", None), tf.distribute.DistributedValues):
                strategy = "the model's variables"
    if strategy is not None:
        name = strategy if isinstance(strategy, str) else type(strategy).__name__
        raise ValueError(
            "EPLTrainer distributes the model itself and cannot run under a tf.distribute "
            f"strategy. Received: {name}. Build and train the model outside "
            "`strategy.scope()`, and give the devices with cluster.* keys."
        )


def build_model(model, features) -> None:
    """Builds an unbuilt (subclassed) model as Keras's first fit does: on symbolic inputs,
    so a call that changes the model's state (a counter, a running statistic) does not
    run. A model that cannot be traced symbolically is called on one row instead."""
    symbolic = tree.map_structure(
        lambda x: keras.KerasTensor(x.shape, dtype=x.dtype.name), features
    )
    try:
        keras.src.backend.compute_output_spec(model, symbolic, training=False)
    except Exception:  # the concrete call below raises the model's own error, if any
        logger.debug("Symbolic build failed; building %s on one row.", model.name, exc_info=True)
    if not model.built:
        model(tree.map_structure(lambda x: x[:1], features))
