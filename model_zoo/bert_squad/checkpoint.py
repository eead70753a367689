"""Loads a Google BERT TF checkpoint (`bert_model.ckpt`) into `modeling.build_squad_model`.

Google's checkpoints are TF1 name-based checkpoints; `tf.train.load_checkpoint` reads
them by name without building their graph. Every `bert/...` variable our model uses must
be present with the same shape (a clear error names the first one that is missing or
mismatched); the pooler and the pre-training heads (`bert/pooler/*`, `cls/predictions/*`,
`cls/seq_relationship/*`) are not used for SQuAD and are ignored. A checkpoint already
fine-tuned by Google's `run_squad.py` also has `cls/squad/output_weights` (stored
[2, hidden], the transpose of our Dense kernel) and `output_bias`: they are loaded when
present, otherwise the QA head keeps its fresh initialisation.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from model_zoo.bert_squad.modeling import TransformerLayer

SQUAD_HEAD = ("cls/squad/output_weights", "cls/squad/output_bias")


def google_variable_names(model: keras.Model) -> dict[str, keras.Variable]:
    """{Google checkpoint name: our variable} for every BERT weight of `model`."""
    names: dict[str, keras.Variable] = {}
    embeddings = model.get_layer("embeddings")
    prefix = "bert/embeddings/"
    names[prefix + "word_embeddings"] = embeddings.word_embeddings
    names[prefix + "token_type_embeddings"] = embeddings.token_type_embeddings
    names[prefix + "position_embeddings"] = embeddings.position_embeddings
    names[prefix + "LayerNorm/gamma"] = embeddings.layer_norm.gamma
    names[prefix + "LayerNorm/beta"] = embeddings.layer_norm.beta
    num_layers = sum(isinstance(layer, TransformerLayer) for layer in model.layers)
    for index in range(num_layers):
        layer = model.get_layer(f"layer_{index}")
        prefix = f"bert/encoder/layer_{index}/"
        dense = {
            "attention/self/query": layer.query,
            "attention/self/key": layer.key,
            "attention/self/value": layer.value,
            "attention/output/dense": layer.attention_output,
            "intermediate/dense": layer.intermediate,
            "output/dense": layer.output_dense,
        }
        for scope, sublayer in dense.items():
            names[f"{prefix}{scope}/kernel"] = sublayer.kernel
            names[f"{prefix}{scope}/bias"] = sublayer.bias
        for scope, norm in (
            ("attention/output/LayerNorm", layer.attention_layer_norm),
            ("output/LayerNorm", layer.output_layer_norm),
        ):
            names[f"{prefix}{scope}/gamma"] = norm.gamma
            names[f"{prefix}{scope}/beta"] = norm.beta
    return names


def load_google_checkpoint(model: keras.Model, path: str) -> list[str]:
    """Assigns the checkpoint's values to `model`'s weights; returns the names loaded.

    Args:
      model: a model from `build_squad_model`, sized like the checkpoint (read its
        `bert_config.json` with `BertConfig.from_json_file`).
      path: the checkpoint prefix, e.g. `uncased_L-12_H-768_A-12/bert_model.ckpt`.

    Raises:
      ValueError: a BERT variable is missing from the checkpoint or has another shape.
    """
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    assignments = []
    for name, variable in google_variable_names(model).items():
        if name not in shapes:
            layers = sorted({n.split("/")[2] for n in shapes if n.startswith("bert/encoder/")})
            raise ValueError(
                f"The checkpoint {path} has no variable {name!r} (it has encoder "
                f"{layers or 'none'}). Is the model configured like the checkpoint's "
                "bert_config.json?"
            )
        assignments.append((name, variable, reader.get_tensor(name)))
    head = model.get_layer("qa_outputs")
    if all(name in shapes for name in SQUAD_HEAD):
        weights, bias = (reader.get_tensor(name) for name in SQUAD_HEAD)
        assignments.append((SQUAD_HEAD[0], head.kernel, np.transpose(weights)))
        assignments.append((SQUAD_HEAD[1], head.bias, bias))
    for name, variable, value in assignments:
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"Checkpoint variable {name!r} has shape {tuple(value.shape)} but the model's "
                f"{variable.path!r} has shape {tuple(variable.shape)}. Is the model configured "
                "like the checkpoint's bert_config.json?"
            )
    for _, variable, value in assignments:
        variable.assign(value.astype(variable.dtype))
    return [name for name, _, _ in assignments]
