"""Tensor split (`epl.split`): layers whose weights are sharded over the lanes of a replica.

With `cluster.colocate_split_and_replicate=True` a model replica of width n has n lanes,
one per device. Layers annotated `replicate` run data parallel on each lane's rows, as
everywhere else. Layers annotated `split` are replaced, while the lane's forward is
traced, by distributed implementations that read only the lane's shard:

* **Dense classifier** (a Dense that produces a model output): the kernel and bias are
  sharded by output column. Each lane all-gathers the features of the replica's rows
  (`LaneCollectives.gather_rows`), computes its slice of the logits for every row, and
  the (sparse) softmax cross-entropy is computed shard-wise: the row maximum and the sum
  of exponentials are reduced across the lanes, so no device ever holds the full logits
  (`sharded_cross_entropy`). Predictions for accuracy metrics come from a distributed
  argmax (`sharded_argmax`).
* **Mixture of experts** (`epl_trainer.layers.MoE`): experts are sharded, routing stays
  local, and tokens travel to their expert's lane and back by all-to-all (`moe_call`).
* **Megatron pair** (split Dense layers, the second called on the first's output, or on
  an element-wise combination of several first layers' outputs: an MLP's up and down
  projections, a gated MLP's gate and up then down): the first layers are
  column-parallel (kernel and bias sharded by output column), the second row-parallel
  (kernel sharded by input row, bias whole).
  Each lane all-gathers the replica's rows into the pair, computes its slice of the
  hidden units for every row (with the first layer's activation, element-wise), then its
  partial sum of the second layer's outputs; a reduce-scatter sums the partials and
  hands each lane its own rows, to which the whole bias and activation are applied. Per
  pair and micro-batch that is one all-gather and one reduce-scatter of the rows forward,
  the same backward (their adjoints): the bytes of Megatron-LM's one all-reduce each
  way, with each lane keeping its own rows between pairs (sequence-parallel style).

Every other layer inside a split scope runs replicated on the lane's own rows.

* **Vocabulary-parallel embedding** (an Embedding whose table a Keras layout shards by
  vocabulary row): each lane all-gathers the token ids of the replica's rows, looks up
  the ids its rows of the table hold (the others give zeros), and a reduce-scatter sums
  the lanes' lookups and hands each lane its own rows: the table never moves. Its
  gradient is the lookups' rows (IndexedSlices), as on one device. A tied table's
  reverse use (KerasHub's `ReversibleEmbedding(tie_weights=True)` logits) reads it
  gathered whole.
* **Gathered variable** (a Keras layout's sharded variable outside any layer the engine
  computes sharded: attention kernels, an MLP inside a subclassed block): each lane holds
  its block (split/blocks.py: a slice over the replica's lanes, or a block over the
  replicas too), and every forward all-gathers the whole value before the model reads
  it (`gather_whole`). Its gradient is the all-gather's adjoint, each lane's block of the
  gradient summed over the lanes (a reduce-scatter), which is the sharded gradient the
  rule below expects (a block over the replicas arrives summed over the whole job).
  Storage follows the layout; the computation is the replicated one, on the lane's own
  rows.

Gradient scaling, so every gradient is still divided by the number of lanes in the job
(the data-parallel mean): lane j's objective is the mean loss over its own rows, as in
plain data parallelism, but the sharded cross-entropy gives each shard the gradient of
*all* the replica's rows. Since every lane's upstream gradient is the same, the shard
of lane j receives sum_m dO_m/dW_j = n * dL_replica/dW_j, and the features of lane j
receive, through the all-gather's adjoint, their own rows' full gradient. Sharded
variables are then summed over the lanes holding the same shard (one per replica) and
divided by the job's lane count, like every replicated variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.common.stateless_scope import StatelessScope

from epl_trainer.core import comm
from epl_trainer.core.engine import objective
from epl_trainer.core.engine.lane_order import traced_as_lane
from epl_trainer.core.engine.split import decoder_blocks
from epl_trainer.core.engine.split.blocks import LaidOutVariable, ShardedVariable
from epl_trainer.core.plan.ir import SplitError


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """One layer replaced by its distributed implementation."""

    layer: keras.layers.Layer | None  # None for "gathered"
    # "dense" (sharded classifier), "column" / "row" (a Megatron pair), "moe", "vocab"
    # (an Embedding's table by vocabulary rows), or "gathered" (one variable sharded for
    # storage, gathered whole on use)
    kind: str
    variables: tuple[ShardedVariable | LaidOutVariable, ...]
    output_index: int | None = None  # dense: which flat model output it produces
    softmax: bool = False  # dense: the layer applies softmax (fused into the loss)
    # "attention" / "mlp": the KerasHub block computed on the lane's shares
    # (decoder_blocks.py); `variables` are its kernels read from the lane's block.
    block: object = None


def is_moe(layer) -> bool:
    return callable(getattr(layer, "route", None)) and callable(getattr(layer, "expert_ffn", None))


def find_split_layers(model, node_taskgraph, taskgraphs, width: int) -> list[SplitLayer]:
    """The layers of split TaskGraphs that get a sharded implementation, validated.

    Args:
      node_taskgraph: {compute node: TaskGraph index} (the model's annotation).
    """
    split_tgs = {tg.index for tg in taskgraphs if tg.kind == "split"}
    layers: dict[int, keras.layers.Layer] = {}
    for node, tg in node_taskgraph.items():
        if tg in split_tgs and isinstance(node.operation, keras.layers.Layer):
            layers.setdefault(id(node.operation), node.operation)
    index_of = {id(v): i for i, v in enumerate(model.trainable_variables)}
    # The sharded layers' variables (a Dense's kernel and bias, an MoE's gate and experts)
    # are trainable ones; a layer frozen (`trainable=False`) has none of them.
    sharded = [
        layer for layer in layers.values() if is_moe(layer) or isinstance(layer, keras.layers.Dense)
    ]
    frozen = sorted(v.path for layer in sharded for v in layer.weights if id(v) not in index_of)
    if frozen:
        raise SplitError(
            "Non-trainable variables in a split TaskGraph (a layer's `trainable` set to "
            f"False): {frozen[:6]}; only trainable variables are held sharded in this "
            "version. Keep the frozen layers out of the split scope (replicated)."
        )
    pairs = megatron_pairs(list(layers.values()))
    paired = {id(layer) for columns, row in pairs for layer in (*columns, row)}
    found = []
    for columns, row in pairs:
        found += [_column_layer(column, index_of, width) for column in columns]
        found.append(_row_layer(row, index_of, width))
    for layer in layers.values():
        if id(layer) in paired:
            continue
        if is_moe(layer):
            found.append(_moe_layer(layer, index_of, width))
        elif isinstance(layer, keras.layers.Dense):
            found.append(_dense_layer(model, layer, index_of, width))
    if not found:
        names = sorted(layer.name for layer in layers.values())
        raise SplitError(
            "The split TaskGraph holds no layer the engine can shard (a Dense classifier "
            f"producing a model output, or an epl_trainer.layers.MoE). Its layers: {names}"
        )
    return found


def _dense_layer(model, layer, index_of, width) -> SplitLayer:
    if len(layer._inbound_nodes) != 1:
        raise SplitError(f"split Dense {layer.name!r} is called more than once; call it once.")
    output = layer._inbound_nodes[0].output_tensors[0]
    outputs = tree.flatten(model.outputs)
    position = next((i for i, t in enumerate(outputs) if t is output), None)
    if position is None:
        raise SplitError(
            f"split Dense {layer.name!r} must produce a model output (its logits are sharded "
            "by class and only the loss and accuracy metrics read them); put the layers "
            "after it outside the split scope or make its output the model's output."
        )
    name = _activation_name(layer)
    if name not in ("linear", "softmax"):
        raise SplitError(
            f"split Dense {layer.name!r} must have a linear or softmax activation (the "
            f"softmax is fused into the sharded cross-entropy). Received: {name!r}"
        )
    variables = _column_variables(layer, index_of, width)
    return SplitLayer(layer, "dense", variables, position, name == "softmax")


def _column_variables(layer, index_of, width) -> tuple[ShardedVariable, ...]:
    """A Dense sharded by output column: its kernel on axis 1, its bias on axis 0."""
    if len(layer.kernel.shape) != 2:
        raise SplitError(f"split Dense {layer.name!r} needs 2-D kernels (features, units).")
    units = layer.kernel.shape[1]
    if units % width:
        raise SplitError(
            f"split Dense {layer.name!r} has units={units}, which the {width} devices of a "
            "replica cannot share evenly (units % devices must be 0)."
        )
    variables = [ShardedVariable(index_of[id(layer.kernel)], 1, width)]
    if layer.use_bias:
        variables.append(ShardedVariable(index_of[id(layer.bias)], 0, width))
    return tuple(variables)


# Layers that act on each hidden unit alone: between a pair's column and row layers they
# run unchanged on a lane's slice of the units (a gated MLP's `gate * up`, an activation).
ELEMENTWISE = (
    keras.layers.Activation,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.ELU,
    keras.layers.Dropout,
    keras.layers.Multiply,
    keras.layers.Add,
    keras.layers.Subtract,
    keras.layers.Maximum,
    keras.layers.Minimum,
)


def megatron_pairs(layers) -> list[tuple]:
    """[(column Dense layers, row Dense)] among the split layers: a Dense called once on
    a tensor computed from other split Dense layers' outputs by element-wise layers only
    (`ELEMENTWISE`; none for a plain MLP), where nothing outside the pair reads the
    columns or the layers between."""
    dense = {id(layer): layer for layer in layers if isinstance(layer, keras.layers.Dense)}
    pairs = []
    for row in dense.values():
        if len(row._inbound_nodes) != 1:
            continue
        found = _columns_feeding(row._inbound_nodes[0].input_tensors[0], dense, row)
        if found is None:
            continue
        columns, between = found
        inside = {id(layer) for layer in (*between, row)}
        for layer in (*columns, *between):
            readers = [node.operation for node in layer._outbound_nodes]
            if len(layer._inbound_nodes) != 1 or any(id(r) not in inside for r in readers):
                raise SplitError(
                    f"{layer.name!r} lies between split Dense {[c.name for c in columns]} and "
                    f"{row.name!r} (a Megatron pair) but is called more than once or read by "
                    "layers outside the pair; a pair's layers must be called once and read "
                    "only inside it."
                )
        pairs.append((tuple(columns), row))
    columns = [column for group, _ in pairs for column in group]
    chained = [row.name for _, row in pairs if row in columns]
    if chained:
        raise SplitError(
            f"split Dense {chained} would be the second layer of one Megatron pair and the "
            "first of another; split the layers in pairs (up, down)."
        )
    return pairs


def _columns_feeding(tensor, dense, row):
    """(column Dense layers, element-wise layers between) that compute `tensor`, or None
    when anything else contributes to it."""
    history = getattr(tensor, "_keras_history", None)
    operation = history.operation if history is not None else None
    if operation is None or operation is row:
        return None
    if id(operation) in dense:
        return [operation], []
    if not isinstance(operation, ELEMENTWISE) or len(operation._inbound_nodes) != 1:
        return None
    columns, between = [], [operation]
    for source in operation._inbound_nodes[0].input_tensors:
        found = _columns_feeding(source, dense, row)
        if found is None:
            return None
        columns += [c for c in found[0] if c not in columns]
        between += [b for b in found[1] if b not in between]
    return columns, between


def _activation_name(layer) -> str:
    activation = keras.activations.serialize(layer.activation)
    return activation if isinstance(activation, str) else activation.get("config", activation)


def _column_layer(layer, index_of, width) -> SplitLayer:
    if _activation_name(layer) == "softmax":
        raise SplitError(
            f"split Dense {layer.name!r} (the first of a Megatron pair) has a softmax "
            "activation, which reads every unit; pairs need an element-wise activation."
        )
    return SplitLayer(layer, "column", _column_variables(layer, index_of, width))


def _row_layer(layer, index_of, width) -> SplitLayer:
    if len(layer.kernel.shape) != 2:
        raise SplitError(f"split Dense {layer.name!r} needs 2-D kernels.")
    return SplitLayer(layer, "row", (ShardedVariable(index_of[id(layer.kernel)], 0, width),))


def laid_out_pairs(model, storage) -> list[tuple]:
    """The Megatron pairs (`megatron_pairs`) among the Dense layers whose kernels
    `storage` names: found on the model's own graph, before a stage cut adds calls."""
    laid_out = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.Dense) and layer.kernel.path in storage
    ]
    return megatron_pairs(laid_out)


def staged_megatron_pairs(model, storage, pairs, width: int, stage_of) -> tuple[list, dict]:
    """The "column" and "row" SplitLayers of the Megatron pairs a Keras layout makes,
    for a model cut in pipeline stages (no split TaskGraph names them there).

    Args:
      storage: {variable path: its layout's (model-axis, batch-axis) dimensions} of the
        pairs' laid-out variables (training/keras_distribution.py `TensorParallel`).
      pairs: `laid_out_pairs(model, storage)`, found before the cut.
      stage_of: a layer -> the pipeline stage computing it.

    Returns:
      (the SplitLayers of the pairs inside one stage, {path: dimensions} of every other
      variable of `storage`, a pair's that a stage boundary cuts: held as laid out,
      gathered on use).
    """
    index_of = {id(v): i for i, v in enumerate(model.trainable_variables)}
    found, computed = [], set()
    for columns, row in pairs:
        members = (*columns, row)
        if len({stage_of(layer) for layer in members}) > 1:
            continue
        found += [_column_layer(column, index_of, width) for column in columns]
        found.append(_row_layer(row, index_of, width))
        computed.update(v.path for layer in members for v in layer.trainable_variables)
    gathered = {path: dims for path, dims in storage.items() if path not in computed}
    return found, gathered


def _moe_layer(layer, index_of, width) -> SplitLayer:
    if layer.num_experts % width:
        raise SplitError(
            f"split MoE {layer.name!r} has num_experts={layer.num_experts}, which the "
            f"{width} devices of a replica cannot share evenly (num_experts % devices must "
            "be 0)."
        )
    variables = tuple(ShardedVariable(index_of[id(v)], 0, width) for v in _expert_weights(layer))
    return SplitLayer(layer, "moe", variables)


def gathered_variables(model, dims_by_path, width: int, replicas: int) -> list[SplitLayer]:
    """One "gathered" SplitLayer per trainable variable `dims_by_path` names, held in
    blocks and gathered whole on use (`storage_specs`)."""
    specs = storage_specs(model, dims_by_path, width, replicas)
    return [SplitLayer(None, "gathered", (spec,)) for spec in specs]


def storage_specs(model, dims_by_path, width: int, replicas: int) -> list:
    """How each trainable variable `dims_by_path` names is held in blocks (blocks.py), in
    its order.

    Args:
      dims_by_path: {variable path: (dimension sliced over a replica's `width` lanes or
        None, dimension sliced over the `replicas` or None)}.
    """
    index_of = {v.path: i for i, v in enumerate(model.trainable_variables)}
    found = []
    for path, (model_dim, batch_dim) in dims_by_path.items():
        if path not in index_of:
            raise SplitError(
                f"Variable {path!r} is laid out sharded but is not a trainable variable of "
                "the model; only trainable variables are held sharded."
            )
        shape = tuple(model.trainable_variables[index_of[path]].shape)
        for dim, parts, what in (
            (model_dim, width, "devices of a replica"),
            (batch_dim, replicas, "replicas"),
        ):
            if dim is not None and shape[dim] % parts:
                raise SplitError(
                    f"Variable {path!r} of shape {shape}: dimension {dim} is not divisible "
                    f"by the {parts} {what}."
                )
        index = index_of[path]
        if batch_dim is None:
            found.append(ShardedVariable(index, model_dim, width))
        else:
            found.append(LaidOutVariable(index, model_dim, batch_dim, width, replicas))
    return found


def vocabulary_parallel(model, paths, width: int, losses=(), metrics=()) -> list[SplitLayer]:
    """A "vocab" SplitLayer for each Embedding whose table's path is in `paths`: the table
    held as `width` slices of vocabulary rows, looked up in place (`_vocab_call`).

    A tied table whose reverse call (KerasHub's `ReversibleEmbedding(tie_weights=True)`)
    produces a model output computes that output's logits by vocabulary slice too, for
    the sharded cross-entropy (its `output_index`), when the output's loss is a plain
    cross-entropy from logits and its metrics are accuracies; otherwise that call reads
    the table gathered whole (`reads_table_whole`).

    Args:
      losses: the Keras loss of each flat model output (None: none).
      metrics: (flat output index, metric) pairs.
    """
    if not paths:
        return []
    index_of = {id(v): i for i, v in enumerate(model.trainable_variables)}
    # A subclassed model has no symbolic outputs: its tied logits are read whole.
    outputs = tree.flatten(getattr(model, "outputs", None) or [])
    found = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Embedding) and layer.embeddings.path in paths:
            if layer.input_dim % width:
                raise SplitError(
                    f"Embedding {layer.name!r} has input_dim={layer.input_dim}, which the "
                    f"{width} devices of a replica cannot share evenly."
                )
            spec = ShardedVariable(index_of[id(layer.embeddings)], 0, width)
            index = _logits_output(layer, outputs, losses, metrics)
            found.append(SplitLayer(layer, "vocab", (spec,), output_index=index))
    return found


def _logits_output(layer, outputs, losses, metrics) -> int | None:
    """The flat output index of `layer`'s tied reverse call (its logits) when the sharded
    cross-entropy can compute its loss and metrics, else None."""
    if not getattr(layer, "tie_weights", False):
        return None
    for index, tensor in enumerate(outputs):
        history = getattr(tensor, "_keras_history", None)
        if history is None or history.operation is not layer:
            continue
        node = layer._inbound_nodes[history.node_index]
        if not node.arguments.kwargs.get("reverse"):
            continue
        loss = losses[index] if index < len(losses) else None
        readers = [m for i, m in metrics if i == index]
        if _sharded_cross_entropy_computes(loss) and all(isinstance(m, _ACCURACY) for m in readers):
            return index
    return None


def _sharded_cross_entropy_computes(loss) -> bool:
    """A sparse or dense cross-entropy from logits, plain and mean over the batch."""
    kind = _cross_entropy_kind(loss) if loss is not None else None
    if kind is None:
        return False
    config = kind[1]
    plain = not _cross_entropy_options(config)
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    return plain and bool(config.get("from_logits")) and reduction in ("sum_over_batch_size", None)


def computed_blocks(model, blocks, width: int, replicas: int) -> list[SplitLayer]:
    """An "attention" or "mlp" SplitLayer for each KerasHub block computed on the lanes'
    shares (decoder_blocks.py), holding the specs of the kernels it reads from the
    lane's block (stored as a Keras layout says: `storage_specs`)."""
    by_path = {layer.path: layer for layer in model._flatten_layers(include_self=False)}
    found = []
    for block in blocks:
        own = {k.path: k.storage for k in block.kernels if k.from_block}
        specs = tuple(storage_specs(model, own, width, replicas))
        found.append(SplitLayer(by_path[block.path], block.kind, specs, block=block))
    return found


def reads_table_whole(split: SplitLayer) -> bool:
    """A vocabulary-parallel table that its layer also reads whole (tied logits the
    sharded cross-entropy does not compute)."""
    tied = bool(getattr(split.layer, "tie_weights", False))
    return split.kind == "vocab" and tied and split.output_index is None


def gather_whole(value, spec, lane_comm, batch_comm=None):
    """The whole variable from this lane's block (`blocks.py`); its gradient is this
    lane's block of the upstream summed over the lanes (rows of a table read by lookups
    stay rows: `LaneCollectives.gather_along`)."""
    if isinstance(spec, LaidOutVariable):
        return spec.gather(value, lane_comm, batch_comm)
    return lane_comm.gather_along(value, spec.axis)


def _expert_weights(layer) -> list:
    """The MoE's stacked expert weights (leading expert axis), in `expert_ffn` order."""
    return [layer.w_in, layer.b_in, layer.w_out, layer.b_out]


class SplitRuntime:
    """The split layers of a program and each local lane's collectives, per stage.

    `lane(li)` makes lane li current while its forward, backward, loss and metrics are
    traced, and `stage(k)` stage k while a stage's forward is (the split stage call
    enters it): a lane's split layers of stage k run among the replica's devices of
    stage k. Outside a stage (the loss, metrics, gradient norms) the last stage is
    current: the model's outputs are computed there. `begin_trace()` gives every lane
    fresh instance keys for a new trace.
    """

    def __init__(
        self,
        split_layers: Sequence[SplitLayer],
        lanes,
        lanes_in_job,
        width: int,
        num_stages: int = 1,
    ):
        self.layers = list(split_layers)
        self.width = width
        self.num_stages = num_stages
        self.sharded = {sv.index: sv for s in self.layers for sv in s.variables}
        self.gathered = {
            sv.index: sv
            for s in self.layers
            if s.kind == "gathered" or reads_table_whole(s)
            for sv in s.variables
        }
        self.lanes = list(lanes)
        by_index = {lane.index: lane for lane in lanes_in_job}
        stages = range(num_stages)
        # _groups[li][k]: lane li's replica's devices of stage k (one per rank).
        self._groups = []
        for lane in self.lanes:
            first = lane.index - lane.index % width
            members = [by_index[first + j] for j in range(width)]
            self._groups.append(
                [
                    comm.CollectiveGroup(tuple(m.devices[k] for m in members), (lane.devices[k],))
                    for k in stages
                ]
            )
        self.ranks = [groups[0].rank_of(groups[0].local_devices[0]) for groups in self._groups]
        for lane, groups in zip(self.lanes, self._groups):
            for k, group in enumerate(groups):
                rank = group.rank_of(group.local_devices[0])
                if rank != lane.index % width:
                    raise SplitError(
                        f"Lane {lane.index} on {lane.devices[k]} has collective rank {rank}, "
                        f"not its position {lane.index % width} in the replica; split needs "
                        "devices whose collective order follows their index."
                    )
        # Variables laid out over the batch axis gather over the lanes of the same rank
        # in every replica, which may sit on other workers.
        self._batch_groups = []
        self._batch_groups_span_workers = False
        if any(isinstance(spec, LaidOutVariable) for spec in self.sharded.values()):
            replicas = len(lanes_in_job) // width
            for lane in self.lanes:
                rank = lane.index % width
                members = [by_index[r * width + rank] for r in range(replicas)]
                self._batch_groups.append(
                    [
                        comm.CollectiveGroup(
                            tuple(member.devices[k] for member in members), (lane.devices[k],)
                        )
                        for k in stages
                    ]
                )
                if len({member.worker for member in members}) > 1:
                    self._batch_groups_span_workers = True
        self.comms: list[list[comm.LaneCollectives]] = []
        self.batch_comms: list[list[comm.LaneCollectives]] = []
        self._active: int | None = None
        self._stage: int | None = None
        self.begin_trace()

    def begin_trace(self) -> None:
        """Fresh instance keys (a block per local replica and stage, and per rank and
        stage for the batch groups) for the next traced function.

        A replica never spans workers, so its keys are process-local
        (`comm.reserve_local_instance_keys`). Batch groups whose replicas sit on several
        workers (one stage: pipelines over a mesh run on one worker) take their keys
        from the group's counter, which every member advances in the same order
        (`comm.reserve_instance_keys`), as ZeRO's gathers across workers do."""
        keys = comm.KEYS_PER_LANE_GROUP
        stages = self.num_stages
        replicas = sorted({lane.index // self.width for lane in self.lanes})
        ranks = sorted({lane.index % self.width for lane in self.lanes})
        local_ranks = (
            len(ranks) if self._batch_groups and not self._batch_groups_span_workers else 0
        )
        first = comm.reserve_local_instance_keys(keys * stages * (len(replicas) + local_ranks))

        def block(start: int, position: int, k: int) -> int:
            return start + (position * stages + k) * keys

        self.comms = [
            [
                comm.LaneCollectives(
                    g, block(first, replicas.index(lane.index // self.width), k), keys
                )
                for k, g in enumerate(groups)
            ]
            for groups, lane in zip(self._groups, self.lanes)
        ]
        batch_first = first + len(replicas) * stages * keys
        if self._batch_groups_span_workers:  # one block per rank's group, in rank order
            group_of = {
                lane.index % self.width: groups[0]
                for groups, lane in zip(self._batch_groups, self.lanes)
            }
            start_of = {(r, 0): comm.reserve_instance_keys(group_of[r].key, keys) for r in ranks}
        else:
            start_of = {
                (r, k): block(batch_first, position, k)
                for position, r in enumerate(ranks)
                for k in range(stages)
            }
        self.batch_comms = [
            [
                comm.LaneCollectives(g, start_of[(lane.index % self.width, k)], keys)
                for k, g in enumerate(groups)
            ]
            for groups, lane in zip(self._batch_groups, self.lanes)
        ]

    @contextlib.contextmanager
    def lane(self, li: int):
        previous, self._active = self._active, li
        try:
            with traced_as_lane(li):
                yield
        finally:
            self._active = previous

    @contextlib.contextmanager
    def stage(self, k: int):
        """Stage k's collectives are the current lane's while its forward is traced."""
        previous, self._stage = self._stage, k
        try:
            yield
        finally:
            self._stage = previous

    @property
    def _current_stage(self) -> int:
        return self.num_stages - 1 if self._stage is None else self._stage

    @property
    def active(self) -> comm.LaneCollectives:
        if self._active is None:
            raise RuntimeError("A split layer ran outside a lane (internal error).")
        return self.comms[self._active][self._current_stage]

    @property
    def active_batch(self) -> comm.LaneCollectives | None:
        """The current lane's collectives over the lanes of its rank in every replica
        (None without variables laid out over the batch axis)."""
        if self._active is None:
            raise RuntimeError("A split layer ran outside a lane (internal error).")
        if not self.batch_comms:
            return None
        return self.batch_comms[self._active][self._current_stage]

    def shard_rank(self, li: int) -> int:
        return self.ranks[li]

    def dense_outputs(self) -> dict[int, SplitLayer]:
        return dense_outputs(self.layers)


def dense_outputs(split_layers: Sequence[SplitLayer]) -> dict[int, SplitLayer]:
    """{flat model output index: the split layer producing it by class slices (a split
    Dense, or a tied table's vocabulary-parallel logits)}."""
    return {
        s.output_index: s
        for s in split_layers
        if s.kind == "dense" or (s.kind == "vocab" and s.output_index is not None)
    }


def split_stage_call(model, runtime: SplitRuntime, training_kwargs, stage: int = 0, indices=None):
    """A stage call (see pipeline.py) that runs split layers on the lane's shards, their
    collectives among the replica's devices of stage `stage`.

    Keras's `stateless_call` insists on a full-shape value for every variable; sharded
    variables are left out of the mapping here and read only by the replacement calls.

    Args:
      model: the stage's sub-model (the whole model with one stage).
      indices: the model-order index of each variable the call takes, in the order it
        takes them (layout.py's `read_idx[stage]`); None: the model's own order.
    """
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    indices = list(range(len(trainable))) if indices is None else list(indices)

    def call(variables, non_trainable_values, args, training):
        with runtime.stage(stage):
            return stage_call(variables, non_trainable_values, args, training)

    def stage_call(variables, non_trainable_values, args, training):
        lane_comm = runtime.active
        sharded_values = {}
        mapping = []
        for i, variable, value in zip(indices, trainable, variables):
            if i in runtime.gathered:  # read whole (a tied table also by its lookups)
                spec = runtime.gathered[i]
                with tf.device(lane_comm.device):
                    whole = gather_whole(value, spec, lane_comm, runtime.active_batch)
                mapping.append((variable, whole))
            if i in runtime.sharded:
                sharded_values[i] = value
            elif i not in runtime.gathered:
                mapping.append((variable, value))
        mapping += list(zip(non_trainable, non_trainable_values))
        with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            with _replaced_calls(runtime, sharded_values, lane_comm, training):
                outputs = model.call(args, **training_kwargs(model, training))
            losses = list(model.losses)
        new_non_trainable = [scope.get_current_value(v) for v in non_trainable]
        return outputs, new_non_trainable, losses

    return call


@contextlib.contextmanager
def _replaced_calls(runtime, sharded_values, lane_comm, training):
    replaced, specs = [], []
    try:
        for split in runtime.layers:
            if split.kind == "gathered":  # read whole through the mapping
                continue
            if any(sv.index not in sharded_values for sv in split.variables):
                continue  # a layer of another pipeline stage
            if split.kind == "row":  # its input is this lane's slice of the hidden units
                specs.append((split.layer, split.layer.input_spec))
                object.__setattr__(split.layer, "input_spec", None)
            shards = [sharded_values[sv.index] for sv in split.variables]
            if split.kind == "dense":
                fn = _dense_call(shards, lane_comm)
            elif split.kind == "column":
                fn = _column_call(split.layer, shards, lane_comm)
            elif split.kind == "row":
                fn = _row_call(split.layer, shards, lane_comm)
            elif split.kind == "vocab":
                fn = _vocab_call(split.layer, shards[0], lane_comm, split.output_index is not None)
            elif split.kind in ("attention", "mlp"):
                fn = decoder_blocks.block_call(
                    split.layer,
                    split.block,
                    split.variables,
                    shards,
                    lane_comm,
                    runtime.active_batch,
                )
            else:
                fn = _moe_call(split.layer, shards, lane_comm)
            object.__setattr__(split.layer, "call", fn)
            replaced.append(split.layer)
        yield
    finally:
        for layer in replaced:
            object.__delattr__(layer, "call")
        for layer, spec in specs:
            object.__setattr__(layer, "input_spec", spec)


def _column_units(inputs, shards, lane_comm):
    """This lane's columns (kernel and bias shards) of a Dense, for every row of the
    replica (rows gathered in rank order)."""
    rows = lane_comm.gather_rows(inputs)
    units = tf.matmul(rows, tf.cast(shards[0], rows.dtype))
    if len(shards) > 1:
        units = units + tf.cast(shards[1], units.dtype)
    return units


def _dense_call(shards, lane_comm):
    def call(inputs, training=None):
        # softmax, if any, is fused into the sharded cross-entropy
        return _column_units(inputs, shards, lane_comm)

    return call


def _column_call(layer, shards, lane_comm):
    """The first layer of a Megatron pair: this lane's hidden units for every row."""

    def call(inputs, training=None):
        return layer.activation(_column_units(inputs, shards, lane_comm))

    return call


def _row_call(layer, shards, lane_comm):
    """The second layer of a Megatron pair: the partial sums of this lane's hidden units,
    summed over the lanes and scattered back to each lane's own rows; then the whole
    bias and the activation (after the sum, as Megatron adds the bias)."""
    kernel = shards[0]

    def call(inputs, training=None):
        partial = tf.matmul(inputs, tf.cast(kernel, inputs.dtype))
        outputs = lane_comm.reduce_scatter_rows(partial)
        if layer.use_bias:
            outputs = outputs + tf.cast(layer.bias.value, outputs.dtype)
        return layer.activation(outputs)

    return call


def _vocab_call(layer, table, lane_comm, sharded_logits: bool):
    """An Embedding's lookup from this lane's vocabulary rows of the table, for every row
    of the replica, summed over the lanes back to each lane's own rows.

    The reverse call of a tied table (logits): with `sharded_logits`, this lane's
    vocabulary slice of the logits for every row of the replica (the rows gathered in;
    Megatron's vocabulary-parallel output layer), which only the sharded cross-entropy
    and accuracy read; else the layer's own, on the whole table gathered into the
    scope's mapping."""
    original = type(layer).call

    def call(inputs, *args, **kwargs):
        if kwargs.get("reverse") or (args and args[0]):
            if not sharded_logits:
                return original(layer, inputs, *args, **kwargs)
            return _logits_slice(layer, table, lane_comm.gather_rows(inputs))
        ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
        ids = lane_comm.gather_rows(ids)
        rows = table.shape[0]
        local = ids - tf.cast(lane_comm.rank * rows, ids.dtype)
        inside = tf.logical_and(local >= 0, local < rows)
        found = tf.gather(table, tf.where(inside, local, tf.zeros_like(local)))
        found = found * tf.cast(inside, found.dtype)[..., None]
        return lane_comm.reduce_scatter_rows(tf.cast(found, layer.compute_dtype))

    return call


def _logits_slice(layer, table, rows):
    """`ReversibleEmbedding.call(reverse=True)` on this lane's rows of the table."""
    dtype = layer.reverse_dtype or rows.dtype
    logits = keras.ops.matmul(tf.cast(rows, dtype), tf.transpose(tf.cast(table, dtype)))
    cap = layer.logit_soft_cap
    return logits if cap is None else keras.ops.tanh(logits / cap) * cap


def _moe_call(layer, shards, lane_comm):
    """The MoE layer's `call` with this lane's E/n experts: routing stays local, and the
    dispatched tokens go to their expert's lane and come back by all-to-all."""

    def call(inputs, training=None):
        training = bool(training)
        n, experts = lane_comm.size, layer.num_experts
        local = experts // n
        d = inputs.shape[-1]
        tokens = tf.reshape(inputs, [layer.num_groups, -1, d])
        routing = layer.route(tokens, training)
        dispatched = layer.dispatch_tokens(tokens, routing.dispatch)  # [E, G*C, d]
        # Block r of the expert axis (experts of rank r) goes to rank r; what arrives is
        # [sender, local expert, slot, d] -> [local expert, sender-major slots, d].
        arrived = tf.reshape(lane_comm.all_to_all(dispatched), [n, local, -1, d])
        mine = tf.reshape(tf.transpose(arrived, [1, 0, 2, 3]), [local, -1, d])
        weights = [tf.cast(w, tokens.dtype) for w in shards]
        done = tf.reshape(layer.expert_ffn(mine, *weights), [local, n, -1, d])
        # Back to the senders: block m holds sender m's tokens; it returns them in
        # expert order ([E, G*C, d]), as `combine_outputs` expects.
        back = tf.reshape(tf.transpose(done, [1, 0, 2, 3]), [experts, -1, d])
        outputs = layer.combine_outputs(lane_comm.all_to_all(back), routing.combine)
        layer.add_loss(layer.aux_loss_coef * routing.aux_loss)
        return tf.reshape(outputs, tf.shape(inputs))

    return call


# ---- the sharded loss and metrics --------------------------------------------------------


def sharded_cross_entropy(logits, labels, lane_comm, sparse: bool, sample_weight=None):
    """Softmax cross-entropy over class-sharded logits; the mean over this lane's rows.

    Args:
      logits: [B, c]: this lane's class slice (classes [rank*c, (rank+1)*c)) of every
        row of the replica (rows in rank order, B = n * b).
      labels: sparse [B] class ids, or dense [B, c] (this lane's class slice).
      lane_comm: the lane's `LaneCollectives`.
      sample_weight: optional [B] weights (rows in the same order).

    Returns:
      sum over this lane's b rows of weight * loss, divided by b (Keras's
      "sum_over_batch_size"). Its gradient covers every row (see the module doc).
    """
    n, rank = lane_comm.size, lane_comm.rank
    logits = tf.cast(logits, tf.float32)
    classes = logits.shape[1]
    rows = tf.shape(logits)[0]
    own = rows // n
    weights = tf.ones([rows]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
    if sparse:
        local = tf.cast(tf.reshape(labels, [-1]), tf.int32) - rank * classes
        inside = tf.logical_and(local >= 0, local < classes)
        onehot = (
            tf.one_hot(tf.where(inside, local, 0), classes) * tf.cast(inside, tf.float32)[:, None]
        )
    else:
        onehot = tf.cast(labels, tf.float32)

    @tf.custom_gradient
    def cross_entropy(x):
        row_max = lane_comm.reduce(tf.reduce_max(x, axis=1), "max")
        exp = tf.exp(x - row_max[:, None])
        local = tf.stack(
            [
                tf.reduce_sum(exp, axis=1),
                tf.reduce_sum(onehot * x, axis=1),
                tf.reduce_sum(onehot, axis=1),
            ],
            axis=1,
        )
        total = lane_comm.reduce(local, "sum")
        sum_exp, target, label_mass = total[:, 0], total[:, 1], total[:, 2]
        per_row = label_mass * (row_max + tf.math.log(sum_exp)) - target
        mine = tf.range(rows) // own == rank
        value = tf.reduce_sum(tf.where(mine, per_row * weights, 0.0)) / tf.cast(own, tf.float32)

        def grad(upstream):
            probs = exp / sum_exp[:, None]
            scale = upstream * weights / tf.cast(own, tf.float32)
            return (probs * label_mass[:, None] - onehot) * scale[:, None]

        return value, grad

    return cross_entropy(logits)


def sharded_argmax(logits, lane_comm):
    """The predicted class of each of this lane's own rows, from class-sharded logits.

    Each lane sends the row maximum and argmax of its slice to the lane owning the row
    (an all-to-all); ties go to the lowest class, as `argmax` of the full logits does.
    """
    n, rank = lane_comm.size, lane_comm.rank
    logits = tf.stop_gradient(tf.cast(logits, tf.float32))
    classes = logits.shape[1]
    best = tf.reduce_max(logits, axis=1)
    arg = tf.cast(tf.argmax(logits, axis=1), tf.int64) + rank * classes
    best = tf.reshape(lane_comm.all_to_all(best), [n, -1])  # [shard, own rows]
    arg = tf.reshape(lane_comm.all_to_all(arg), [n, -1])
    winner = tf.argmax(best, axis=0, output_type=tf.int32)
    return tf.gather(tf.transpose(arg), winner, batch_dims=1)


def gather_dense_labels(labels, lane_comm):
    """One-hot labels [b, C] of this lane's rows -> [B, c]: every row, this lane's classes."""
    n = lane_comm.size
    b, classes = tf.shape(labels)[0], labels.shape[1]
    blocks = tf.transpose(tf.reshape(labels, [b, n, classes // n]), [1, 0, 2])
    return tf.reshape(lane_comm.all_to_all(blocks), [-1, classes // n])


_SPARSE_CE = "sparse_categorical_crossentropy"
_DENSE_CE = "categorical_crossentropy"


def _cross_entropy_kind(loss) -> tuple[str, dict] | None:
    """("sparse" | "dense", config) for a Keras softmax cross-entropy, else None."""
    fn = getattr(loss, "fn", None)
    name = getattr(fn, "__name__", "")
    config = dict(getattr(loss, "_fn_kwargs", {}) or {})
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy) or name == _SPARSE_CE:
        return "sparse", config
    if isinstance(loss, keras.losses.CategoricalCrossentropy) or name == _DENSE_CE:
        return "dense", config
    return None


# The options the sharded cross-entropy does not compute, with the values that turn them
# off (ignore_class=0 ignores class 0: only None is off).
_OFF = {"label_smoothing": (0, 0.0, None), "ignore_class": (None,), "axis": (-1, None)}


def _cross_entropy_options(config: dict) -> dict:
    """The options of a cross-entropy's `config` that are on and not computed sharded."""
    return {k: v for k, v in config.items() if k in _OFF and v not in _OFF[k]}


def sparse_outputs(losses, split_layers: Sequence[SplitLayer]) -> dict[int, bool]:
    """{split output index: sparse labels?}, checking each split output's loss."""
    found = {}
    for index, split in dense_outputs(split_layers).items():
        loss = losses[index]
        kind = _cross_entropy_kind(loss)
        if kind is None:
            raise SplitError(
                f"The output of split Dense {split.layer.name!r} needs a (sparse) "
                "categorical cross-entropy loss, computed shard-wise. Received: "
                f"{type(loss).__name__} {getattr(loss, 'name', '')!r}"
            )
        sparse, config = kind
        from_logits = bool(config.get("from_logits", False))
        if from_logits == split.softmax:
            raise SplitError(
                f"split Dense {split.layer.name!r} has "
                f"activation={'softmax' if split.softmax else 'linear'} but its loss has "
                f"from_logits={from_logits}; use softmax with from_logits=False or a linear "
                "activation with from_logits=True."
            )
        unsupported = _cross_entropy_options(config)
        if unsupported or getattr(loss, "reduction", "sum_over_batch_size") not in (
            "sum_over_batch_size",
            None,
        ):
            raise SplitError(
                f"The loss of split Dense {split.layer.name!r} must be a plain cross-entropy "
                f"(mean over the batch). Received options: {unsupported or loss.reduction}"
            )
        found[index] = sparse == "sparse"
    return found


class SplitLoss:
    """The trainer's loss with every split Dense output computed shard-wise.

    Called inside a lane (see `SplitRuntime.lane`); other outputs use their Keras loss.
    """

    def __init__(self, compiled_loss, runtime: SplitRuntime, num_outputs: int):
        self.runtime = runtime
        self.compiled_loss = compiled_loss
        self.trackers = compiled_loss.trackers
        self.flat_labels = compiled_loss.flat_labels
        self.sparse = {}  # {split output index: sparse labels?}: none without split outputs
        if dense_outputs(runtime.layers):
            self.sparse = sparse_outputs(compiled_loss.losses_for(num_outputs), runtime.layers)

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The micro-batch's loss (Keras's value on this lane's rows)."""
        terms = self.terms(y_true, y_pred, sample_weight)
        return tf.add_n([term.total / term.divisor for term in terms])

    def terms(self, y_true, y_pred, sample_weight=None, real_rows=None) -> list[objective.LossTerm]:
        """Each loss's weighted sum and divisor (objective.py); a split output's is the
        sharded cross-entropy's sum over this lane's rows."""
        flat_true, flat_pred = self.flat_labels(y_true, y_pred), tree.flatten(y_pred)
        lane_comm = self.runtime.active
        terms = []
        for entry in self.compiled_loss.entries:
            index, weight = entry.index, entry.weight
            t = tree.map_structure(lambda i: flat_true[i], index)
            p = tree.map_structure(lambda i: flat_pred[i], index)
            if not isinstance(index, int) or index not in self.sparse:
                terms.append(
                    objective.keras_loss_term(entry.loss, t, p, sample_weight, weight, real_rows)
                )
                continue
            sequence = p.shape.rank > 2  # [rows, tokens..., classes]: every token a row
            if sequence and not self.sparse[index]:
                raise ValueError(
                    "The sharded cross-entropy of logits per token takes sparse labels (class "
                    f"ids). Received: labels of shape {t.shape} for logits of shape {p.shape}"
                )
            if sample_weight is not None and sample_weight.shape.rank not in (1, t.shape.rank):
                raise ValueError(
                    "A split output's sharded cross-entropy takes one sample weight per row "
                    f"(or per label). Received: sample_weight of shape {sample_weight.shape} "
                    f"for labels of shape {t.shape}"
                )
            with tf.device(lane_comm.device):
                labels = (
                    lane_comm.gather_rows(tf.reshape(t, [-1]))
                    if self.sparse[index]
                    else gather_dense_labels(t, lane_comm)
                )
                weights = None
                if sample_weight is not None:
                    weights = tf.cast(sample_weight, tf.float32)
                    if sequence:  # a row's weight for each of its tokens
                        shape = [-1] + [1] * (t.shape.rank - weights.shape.rank)
                        weights = tf.broadcast_to(tf.reshape(weights, shape), tf.shape(t))
                    weights = tf.reshape(lane_comm.gather_rows(weights), [-1])
                if sequence:  # rank-major rows stay rank-major tokens
                    p = tf.reshape(p, [-1, p.shape[-1]])
                mean = sharded_cross_entropy(p, labels, lane_comm, self.sparse[index], weights)
                rows = tf.cast(tf.shape(t)[0], tf.float32)
                total = mean * rows
                terms.append(
                    objective.LossTerm(total * weight, rows, objective.PER_ROW, rows, total)
                )
        return terms


_ACCURACY = (keras.metrics.SparseCategoricalAccuracy, keras.metrics.CategoricalAccuracy)


def check_split_metrics(metrics, split_layers: Sequence[SplitLayer]) -> None:
    """Only accuracy can be computed from sharded logits (by a distributed argmax)."""
    outputs = dense_outputs(split_layers)
    for index, metric in metrics:
        if index in outputs and not isinstance(metric, _ACCURACY):
            raise SplitError(
                f"Metric {metric.name!r} reads the sharded logits of split Dense "
                f"{outputs[index].layer.name!r}; only SparseCategoricalAccuracy and "
                'CategoricalAccuracy ("accuracy") are computed on split outputs.'
            )


def update_split_accuracy(metric, labels, logits, lane_comm, sample_weight=None) -> None:
    """Updates an accuracy metric from this lane's rows, predicted by `sharded_argmax`."""
    with tf.device(lane_comm.device):
        predicted = sharded_argmax(tf.reshape(logits, [-1, logits.shape[-1]]), lane_comm)
        if isinstance(metric, keras.metrics.CategoricalAccuracy):
            truth = tf.argmax(labels, axis=-1)
        else:
            truth = tf.cast(tf.reshape(labels, [-1]), tf.int64)
        matches = tf.cast(tf.equal(truth, predicted), tf.float32)
        if logits.shape.rank > 2:  # per token, as Keras's metric sees them
            matches = tf.reshape(matches, tf.shape(truth if truth.shape.rank > 1 else labels))
    # Skip the wrapper's own function (it would need the full logits) and feed the mean.
    keras.metrics.Mean.update_state(metric, matches, sample_weight=sample_weight)
