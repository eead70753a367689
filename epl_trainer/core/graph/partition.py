"""Cuts a functional Keras model into one sub-model per TaskGraph.

Assignment is per Keras *node* (one call of a layer), not per layer name, so a shared
layer called twice has two nodes. Tensors that cross a boundary are routed by identity:
every tensor has a key, each stage reads its inputs from a table of keys filled by the
model inputs and earlier stages, so a skip connection from stage 0 to stage 2 needs no
pass-through in stage 1. Sub-models are `keras.Model(inputs=<intermediate tensors>,
outputs=...)` and share the original layer objects (and so their variables).

A trainable weight may be used by several stages (tied input and output embeddings: the
token embedding computes the logits again); each stage's sub-model then lists it, and
the engine gives each of those stages its own copy (state.py). A non-trainable weight
(BatchNorm statistics, updated by its forward) must stay in one stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import keras
from keras import tree

TensorKey = tuple[str, int, int]  # (operation name, node index, output index)


class PartitionError(ValueError):
    """A stage assignment that cannot be executed as a pipeline."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One TaskGraph's piece of the model."""

    index: int
    model: keras.Model
    input_keys: tuple[TensorKey, ...]
    output_keys: tuple[TensorKey, ...]
    layer_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A model cut into stages; `forward` runs them in order (the reference executor)."""

    model: keras.Model
    stages: tuple[Stage, ...]
    input_keys: tuple[TensorKey, ...]  # model inputs, flattened in the model's input order
    output_keys: tuple[TensorKey, ...]  # model outputs, flattened
    whole_model: bool = False  # one stage that takes and returns the model's own structures
    optional_inputs: tuple[str, ...] = ()  # a whole model's inputs the data may leave out

    def flatten_inputs(self, x) -> list:
        if self.whole_model:
            return [x]
        flat = tree.flatten(x)
        if len(flat) != len(self.input_keys):
            raise ValueError(
                f"The model takes {len(self.input_keys)} input tensor(s) but the data has "
                f"{len(flat)}. Received element structure: {tree.map_structure(_shape_of, x)}"
            )
        return flat

    def pack_outputs(self, flat_outputs: Sequence):
        if self.whole_model:
            return flat_outputs[0]
        # A Sequential keeps its output structure on the functional graph it builds.
        outputs_struct = functional_graph(self.model)._outputs_struct
        return tree.pack_sequence_as(outputs_struct, list(flat_outputs))

    def forward(self, x, training: bool = False):
        """Runs the stages with their own variables; equals `model(x)`."""
        flat = self.flatten_inputs(x)
        if not self.whole_model:
            # Convert as model(x) does: a later stage may get a routed model input next to
            # tensors from earlier stages, and Keras refuses arrays mixed with tensors.
            graph_inputs = functional_graph(self.model).inputs
            flat = [
                v if v is None else keras.ops.convert_to_tensor(v, dtype=t.dtype)
                for v, t in zip(flat, graph_inputs)
            ]
        values = dict(zip(self.input_keys, flat))
        for stage in self.stages:
            outputs = stage.model(self.stage_arguments(stage, values), training=training)
            values.update(self.stage_results(stage, outputs))
        return self.pack_outputs([values[k] for k in self.output_keys])

    def stage_arguments(self, stage: Stage, values: Mapping):
        """The argument to call `stage.model` with, from the table of routed tensors."""
        if self.whole_model:
            return with_absent_inputs(self.optional_inputs, values[stage.input_keys[0]])
        return [values[k] for k in stage.input_keys]

    def stage_results(self, stage: Stage, outputs) -> dict:
        """Table entries for a stage's outputs."""
        if self.whole_model:
            return {stage.output_keys[0]: outputs}
        return dict(zip(stage.output_keys, tree.flatten(outputs)))


def whole_model(model: keras.Model) -> StagedModel:
    """One stage holding the unmodified model (any model type, including subclassed)."""
    stage = Stage(
        0,
        model,
        (("inputs", 0, 0),),
        (("outputs", 0, 0),),
        tuple(layer.name for layer in model.layers),
    )
    return StagedModel(
        model,
        (stage,),
        stage.input_keys,
        stage.output_keys,
        whole_model=True,
        optional_inputs=optional_input_names(model),
    )


def with_absent_inputs(optional_inputs: Sequence[str], x):
    """A features dict with None for the optional inputs the data left out (tf.data holds
    no None): the model then sees them as Keras's `fit` passes them."""
    if not optional_inputs or not isinstance(x, Mapping):
        return x
    return {**dict.fromkeys(optional_inputs), **x}


def optional_input_names(model) -> tuple[str, ...]:
    """The names of a dict-input model's optional inputs (`keras.Input(optional=True)`),
    which may be None."""
    inputs = getattr(model, "_inputs_struct", None)
    if not isinstance(inputs, Mapping):
        return ()
    layers = {name: getattr(t, "_keras_history", (None,))[0] for name, t in inputs.items()}
    return tuple(name for name, layer in layers.items() if getattr(layer, "optional", False))


def tensor_key(tensor) -> TensorKey:
    history = tensor._keras_history
    # keras.Model(inputs=<an Input plus intermediate tensors>) re-creates the InputLayer's
    # node and rewrites the original Input tensor's history (node_index 1, 2, ...). An
    # Input tensor has one real node, so its key stays at node 0.
    is_input = isinstance(history.operation, keras.layers.InputLayer)
    node_index = 0 if is_input else history.node_index
    return (history.operation.name, node_index, history.tensor_index)


def functional_graph(model: keras.Model) -> keras.Model:
    """The functional graph behind a model (Sequential builds one internally)."""
    if isinstance(model, keras.Sequential):
        if not model.built or getattr(model, "_functional", None) is None:
            raise PartitionError(
                f"Sequential model {model.name!r} has no input shape yet; give its first layer "
                "an `input_shape` or call it once before partitioning."
            )
        return model._functional
    if not hasattr(model, "_nodes_by_depth"):
        raise PartitionError(
            f"Model {model.name!r} ({type(model).__name__}) is a subclassed model: only "
            "functional and Sequential models can be cut into several TaskGraphs. Use one "
            "TaskGraph (plain data parallelism) or rebuild it with the functional API."
        )
    return model


def compute_nodes(model: keras.Model) -> list:
    """The model's layer/op calls in topological order, without input placeholders."""
    graph = functional_graph(model)
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if not node.is_input and not isinstance(node.operation, keras.layers.InputLayer):
                nodes.append(node)
    return nodes


def partition_model(
    model: keras.Model, node_stage: Mapping | Callable, num_stages: int
) -> StagedModel:
    """Cuts `model` into `num_stages` sub-models.

    Args:
      model: a functional or Sequential Keras model.
      node_stage: a mapping (or callable) from each compute node to its stage index.
      num_stages: number of stages; every stage must receive at least one node.

    Raises:
      PartitionError: a stage consumes a later stage's output, a stage is empty, a
        stage reads the output of a layer it calls again, or a non-trainable weight
        would be used by two stages.
    """
    graph = functional_graph(model)
    stage_of = node_stage if callable(node_stage) else node_stage.__getitem__
    nodes = compute_nodes(graph)
    producer_stage: dict[TensorKey, int] = {tensor_key(t): -1 for t in graph.inputs}
    assigned: list[list] = [[] for _ in range(num_stages)]
    for node in nodes:
        stage = stage_of(node)
        if not 0 <= stage < num_stages:
            raise PartitionError(
                f"Layer {node.operation.name!r} was assigned to stage {stage}, but there are "
                f"{num_stages} stages (0..{num_stages - 1})."
            )
        for tensor in node.input_tensors:
            source = producer_stage[tensor_key(tensor)]
            if source > stage:
                raise PartitionError(
                    f"Stage {stage} (layer {node.operation.name!r}) consumes "
                    f"{tensor_key(tensor)[0]!r}, an output of the later stage {source}. "
                    "Stages must only consume outputs of earlier stages."
                )
        for tensor in node.output_tensors:
            producer_stage[tensor_key(tensor)] = stage
        assigned[stage].append(node)
    for stage, stage_nodes in enumerate(assigned):
        if not stage_nodes:
            raise PartitionError(
                f"Stage {stage} of {num_stages} has no layers. Every stage needs at least one."
            )
    output_keys = tuple(tensor_key(t) for t in graph.outputs)
    consumer_stages: dict[TensorKey, set[int]] = {}
    for node in nodes:
        for tensor in node.input_tensors:
            consumer_stages.setdefault(tensor_key(tensor), set()).add(stage_of(node))
    # Before building sub-models: keras.Model fails cryptically on some shared layers.
    _check_non_trainable_in_one_stage(assigned)
    stages = tuple(
        _build_stage(k, assigned[k], producer_stage, consumer_stages, output_keys)
        for k in range(num_stages)
    )
    return StagedModel(model, stages, tuple(tensor_key(t) for t in graph.inputs), output_keys)


def _build_stage(index, nodes, producer_stage, consumer_stages, model_output_keys) -> Stage:
    tensors = {}
    consumed_outside: dict[TensorKey, None] = {}
    for node in nodes:
        for tensor in node.input_tensors:
            key = tensor_key(tensor)
            tensors[key] = tensor
            if producer_stage[key] != index:
                consumed_outside[key] = None
        for tensor in node.output_tensors:
            tensors[tensor_key(tensor)] = tensor
    produced = {tensor_key(t) for node in nodes for t in node.output_tensors}
    outputs = [
        k for k in produced if consumer_stages.get(k, set()) - {index} or k in model_output_keys
    ]
    outputs.sort(key=lambda k: (k not in model_output_keys, k))
    if not outputs:
        raise PartitionError(f"Stage {index} produces nothing that later stages or the model use.")
    inputs = list(consumed_outside)
    # keras.Model clones the graph between intermediate inputs and outputs and maps the
    # *layer* that produced each input to a new InputLayer (Keras 3 clone_graph_nodes),
    # so another call of that layer inside this stage would be replaced too.
    stage_operations = {id(node.operation) for node in nodes}
    for key in inputs:
        operation = tensors[key]._keras_history.operation
        if id(operation) in stage_operations:
            raise PartitionError(
                f"Layer {operation.name!r} is called in stage {producer_stage[key]} and again "
                f"in stage {index}, which consumes the output of the first call: Keras "
                "cannot cut such a stage. Assign both calls of that layer to the same "
                "stage, or cut elsewhere."
            )
    input_tensors = [tensors[k] for k in inputs]
    # keras.Model re-creates the node of a model Input given here and points the Input
    # tensor's history at that new node, which the user's model does not know: its
    # get_config (to_json, save, TensorBoard's graph) would then fail. Restore them.
    histories = [(t, t._keras_history) for t in input_tensors]
    sub_model = keras.Model(
        inputs=input_tensors,
        outputs=[tensors[k] for k in outputs],
        name=f"stage_{index}",
    )
    for tensor, history in histories:
        tensor._keras_history = history
    names = tuple(dict.fromkeys(node.operation.name for node in nodes))
    return Stage(index, sub_model, tuple(inputs), tuple(outputs), names)


def _check_non_trainable_in_one_stage(assigned: Sequence[Sequence]) -> None:
    """Every non-trainable variable is used by the nodes of one stage only
    (`assigned[k]`: stage k's nodes). Trainable ones may be shared (tied weights)."""
    owner: dict[int, int] = {}
    for stage, nodes in enumerate(assigned):
        for node in nodes:
            for variable in getattr(node.operation, "non_trainable_weights", ()):
                first = owner.setdefault(id(variable), stage)
                if first != stage:
                    raise PartitionError(
                        f"Non-trainable weight {variable.path!r} is used by stage {first} "
                        f"and stage {stage}: its updates (e.g. BatchNorm statistics) would "
                        "differ between the stages. Assign all calls of that layer to the "
                        "same stage."
                    )


def _shape_of(x):
    return getattr(x, "shape", type(x).__name__)
