"""Keras's distribution API (`keras.distribution`) through EPLTrainer on TensorFlow.

Keras defines one distribution API (`DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`, `set_distribution`, `Distribution.scope()`), which its TensorFlow backend
does not run: a model trains replicated on one device. EPLTrainer follows it: a
distribution given as `strategy=`, or the one set or in scope when the trainer is made,
lays out the run.

- The mesh's devices are the run's devices, in the mesh's order (Keras's names,
  `"cpu:3"` / `"gpu:1"`, or TensorFlow's); with several workers the mesh is the job's or
  each worker's own (`mesh_cluster`), and the batch axis extends over the workers.
- The batch axis (`batch_dim_name`) is the data-parallel lanes.
- Each variable's layout is Keras's own answer (`Distribution.get_variable_layout`: an
  explicit layout, else the `LayoutMap`'s exact key, else its one `re.fullmatch`, two
  matches being Keras's error). A layout must fit the variable: its rank, and every
  sharded dimension divisible by its mesh axis (else an error naming the variable, its
  shape, the axis and its size).

What runs in this version:

- data parallelism over every mesh device, whenever no variable is sharded (a
  `DataParallel`; a `ModelParallel` whose map shards nothing, such as a model axis of
  size 1): every device computes the step Keras's `DataParallel` does, the mean gradient
  of the global batch;
- tensor parallelism over the model axis otherwise, every device of a model-axis group
  one lane, the batch axis the replicas:
  - where the layouts make Megatron pairs of Dense layers (the first laid out
    `(None, "model")`, its bias `("model",)`, read only by the second, laid out
    `("model", None)`, directly or through element-wise layers such as a gated MLP's
    `gate * up`), the pairs compute sharded as `epl.split`'s column -> row pairs
    (split/layers.py);
  - an Embedding whose table is laid out by vocabulary row over the model axis looks up
    in place (split/layers.py `_vocab_call`);
  - every other sharded variable (attention kernels, an MLP inside a subclassed block,
    a table also sharded over the batch axis, as KerasHub's maps lay them out) is held
    as its block, over the model axis, the batch axis or both, and gathered whole on
    use, its gradient reduce-scattered back to the blocks (split/blocks.py): storage
    follows the layout, the computation is the replicated one.

Pipeline stages (a stage map, `epl.replicate` stage scopes, or `auto.auto_parallel`)
stay a third dimension: the run trains on batch x model x stages devices, the mesh's
devices running stage 0 and each later stage the next group of the worker's devices,
laid out as the mesh (`stage_cluster`); each stage's sharded variables are held and its
sharded layers computed among its own devices (a Megatron pair a stage boundary cuts is
gathered on use).

Layouts of layer outputs, and blocks over the batch axis with replicas on several
workers, are refused by name rather than trained replicated.
"""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

from epl_trainer.core.engine import split
from epl_trainer.core.plan import mesh as mesh_plan
from epl_trainer.core.plan.ir import SplitError

_DEVICE = re.compile(r"(?:.*/device:)?(?P<type>[A-Za-z]+):(?P<index>\d+)")


def requested(strategy):
    """The Keras distribution the trainer follows: `strategy` when it is one; with no
    strategy, the one `keras.distribution.set_distribution` set or `scope()` made current;
    else None."""
    if isinstance(strategy, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
        return strategy
    if strategy is None:
        return keras.distribution.distribution()
    return None


def mesh_cluster(distribution, cluster):
    """`cluster` with the mesh's devices as its devices, in the mesh's order.

    A mesh is the job's (as Keras's meshes are on JAX) when it names every worker's
    devices: TensorFlow names with their task, or Keras's `list_devices()` names, which
    on TensorFlow repeat `"cpu:0"`... once per worker, worker by worker (each worker then
    takes its share in order). Otherwise it is each worker's own devices, and the batch
    axis extends over the workers.

    Raises:
      ValueError: a mesh device this worker does not have, of another type than the
        cluster's devices (a "cpu" mesh on a GPU worker), named twice, or a mesh that the
        workers cannot share evenly.
    """
    mesh = distribution.device_mesh
    # Batch-major: lane b * width + m is mesh position (batch b, model m), whichever
    # axis the mesh names first.
    grid = np.moveaxis(
        np.asarray(mesh.devices), mesh.axis_names.index(distribution.batch_dim_name), 0
    )
    names = [str(name) for name in grid.reshape(-1)]
    shares = _worker_shares(names, cluster.worker_num)
    own = [_device_index(name, cluster, names) for name in shares[cluster.worker_index]]
    if len(set(own)) != len(own):
        raise ValueError(f"The mesh names a device twice. Received mesh devices: {names}")

    def on_worker(worker: int) -> tuple[str, ...]:
        prefix = cluster.devices_by_worker[worker][0].rsplit("/device:", 1)[0]
        indices = [int(_DEVICE.fullmatch(name)["index"]) for name in shares[worker]]
        return tuple(f"{prefix}/device:{cluster.device_type}:{i}" for i in indices)

    by_worker = tuple(on_worker(w) for w in range(cluster.worker_num))
    return dataclasses.replace(
        cluster, local_devices=by_worker[cluster.worker_index], devices_by_worker=by_worker
    )


_TASK = re.compile(r".*/task:(?P<task>\d+)/.*")


def _worker_shares(names: list[str], workers: int) -> list[list[str]]:
    """Each worker's mesh devices, by worker index."""
    if workers == 1:
        return [names]
    tasks = [_TASK.fullmatch(name) for name in names]
    if all(tasks):
        shares = [[n for n, t in zip(names, tasks) if int(t["task"]) == w] for w in range(workers)]
    elif len(set(names)) < len(names):  # Keras's names of every worker's devices
        if len(names) % workers:
            raise ValueError(
                f"A mesh of {len(names)} devices over {workers} workers: each worker must "
                f"hold as many. Received mesh devices: {names}"
            )
        size = len(names) // workers
        shares = [names[w * size : (w + 1) * size] for w in range(workers)]
    else:  # this worker's own devices; every worker has its own mesh like it
        return [names] * workers
    if len({len(share) for share in shares}) != 1:
        raise ValueError(
            f"The mesh's devices are not shared evenly by the {workers} workers: "
            f"{[len(share) for share in shares]} devices each. Received mesh devices: {names}"
        )
    return shares


def _device_index(name: str, cluster, names: list[str]) -> int:
    """The index of mesh device `name` among this worker's devices, checked."""
    available = {
        (device.device_type.upper(), int(device.name.rsplit(":", 1)[1]))
        for device in tf.config.list_logical_devices()
    }
    match = _DEVICE.fullmatch(name)
    kind = match["type"].upper() if match else None
    if match is None or (kind, int(match["index"])) not in available:
        raise ValueError(
            f"The mesh's device {name!r} is not a device of this worker. Its devices: "
            f"{sorted(f'{k.lower()}:{i}' for k, i in available)}"
        )
    if kind != cluster.device_type:
        raise ValueError(
            f"The mesh's device {name!r} is a {kind} device; this worker trains on its "
            f"{cluster.device_type} devices. Received mesh devices: {names}"
        )
    return int(match["index"])


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """One variable's layout as Keras gives it: `axes[d]` is the mesh axis dimension d is
    sharded over (None: whole), `sharded` the dimensions over an axis of size > 1."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    sharded: tuple[int, ...]


def variable_layouts(distribution, model) -> list[VariableLayout]:
    """Every variable's layout (Keras's lookup), checked against its shape and the mesh."""
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    layouts = []
    for variable in model.variables:
        shape = tuple(int(d) for d in variable.shape)
        axes = tuple(distribution.get_variable_layout(variable).axes)
        sharded = mesh_plan.sharded_dimensions(variable.path, shape, axes, sizes)
        layouts.append(VariableLayout(variable.path, shape, axes, sharded))
    return layouts


def output_layouts(distribution, model) -> dict[str, object]:
    """{"<layer path>/output": layout} of the layer outputs the distribution lays out
    (Keras's `Layer.__call__` relayouts them, which its TensorFlow backend cannot)."""
    found = {}
    for layer in model._flatten_layers(include_self=False):
        key = f"{layer.path}/output"
        layout = distribution.get_tensor_layout(key)
        if layout is not None:
            found[key] = layout.axes
    return found


def unmatched_keys(distribution, model) -> list[str]:
    """The layout map's keys that lay out nothing of `model`: no variable path equal to
    the key or fully matching it as a regex, and no layer's `"<layer>/output"`. Keras
    leaves such a variable replicated without a word, so a misspelt key would train a
    layout other than the one written."""
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None:
        return []
    paths = [v.path for v in model.variables]
    paths += [f"{layer.path}/output" for layer in model._flatten_layers(include_self=False)]
    return [key for key in layout_map if not any(p == key or re.fullmatch(key, p) for p in paths)]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What a layout map's sharded variables run as, over the model axis.

    Attributes:
      width: the model axis's size (the lanes of one tensor-parallel group).
      layers: the Dense layers of Megatron pairs, computed sharded (`epl.split`'s
        column-then-row pairs, split/layers.py), as split patterns.
      gathered: {variable path: (its dimension sharded over the model axis, over the
        batch axis; None where none is)} of every other sharded variable: held as its
        block, gathered whole on use (split/blocks.py).
    """

    width: int
    layers: tuple[str, ...]
    gathered: dict[str, tuple[int | None, int | None]] = dataclasses.field(default_factory=dict)
    vocabulary: tuple[str, ...] = ()
    # KerasHub blocks computed on each lane's shares (decoder_blocks.py), and the known
    # blocks that are not, with why.
    blocks: tuple = ()
    unfit_blocks: dict[str, str] = dataclasses.field(default_factory=dict)
    # The model's own train_step reads its variables through Keras's call, which the
    # engine's sharded computations do not replace: every sharded variable is gathered.
    own_steps: bool = False
    # {variable path: (model-axis dimension, batch-axis dimension)} of the pairs'
    # laid-out variables: under pipeline stages a pair a stage boundary cuts is gathered.
    pair_storage: dict[str, tuple[int | None, int | None]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        if self.own_steps:
            return (
                f"tensor parallel over {self.width} devices; the model's own steps read every "
                f"sharded variable gathered on use (held sharded): "
                + (", ".join(self.gathered) or "none")
            )
        computed = ", ".join(self.layers) or "none"
        vocabulary = ", ".join(self.vocabulary) or "none"
        gathered = ", ".join(self.gathered) or "none"
        text = (
            f"tensor parallel over {self.width} devices; computed sharded (Megatron pairs): "
            f"{computed}; vocabulary-parallel lookups: {vocabulary}; held sharded, gathered "
            f"on use: {gathered}"
        )
        if self.blocks:
            text += "; computed sharded in blocks: " + ", ".join(b.describe() for b in self.blocks)
        if self.unfit_blocks:
            text += "; blocks computed whole: " + ", ".join(
                f"{path} ({why})" for path, why in self.unfit_blocks.items()
            )
        return text


def plan(distribution, model, own_steps: bool = False) -> TensorParallel | None:
    """How the run follows `distribution`: None for data parallelism over every mesh
    device (no variable is sharded), else the tensor parallelism its layouts give:
    Megatron pairs of Dense layers where the layouts make them, every other sharded
    variable gathered on use. With `own_steps` (a model running its own train_step:
    core/engine/user_steps.py) every sharded variable is gathered on use.

    Raises:
      ValueError: a layout this version does not train, naming it: a mesh with two
        model axes, a sharded non-trainable variable, or a layout of layer outputs.
    """
    layouts = {v.path: v for v in variable_layouts(distribution, model)}
    outputs = output_layouts(distribution, model)
    if outputs:
        raise ValueError(
            "Layouts of layer outputs are not applied on TensorFlow (Keras's Layer relayouts "
            f"them with the backend's distribute_tensor, which TensorFlow lacks). Received: "
            f"{outputs}"
        )
    sharded = {path: v for path, v in layouts.items() if v.sharded}
    if not sharded:
        return None
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    batch = distribution.batch_dim_name
    others = [a for a in mesh.axis_names if a != batch and sizes[a] > 1]
    if len(others) > 1:
        raise ValueError(
            f"The mesh {sizes} has several model axes of size > 1 {others}; one "
            "tensor-parallel axis besides the batch axis is trained in this version."
        )
    axis = others[0] if others else None
    trainable = {v.path for v in model.trainable_variables}
    frozen = [_named(sharded[p]) for p in sharded if p not in trainable]
    if frozen:
        raise ValueError(
            f"Non-trainable variables are laid out sharded: {frozen[:6]}; only trainable "
            "variables are held sharded in this version. Lay them out replicated."
        )
    twice = [
        _named(v) for v in sharded.values() if len({v.axes[d] for d in v.sharded}) < len(v.sharded)
    ]
    if twice:
        raise ValueError(f"Layouts name one mesh axis for two dimensions: {twice[:6]}")

    def dimension(layout, mesh_axis):
        return next((d for d in layout.sharded if layout.axes[d] == mesh_axis), None)

    width = sizes[axis] if axis is not None else 1
    if own_steps:
        every = {path: (dimension(v, axis), dimension(v, batch)) for path, v in sharded.items()}
        return TensorParallel(width, (), every, own_steps=True)
    roles = _pair_roles(model, layouts, axis, sizes) if axis is not None else {}
    paired = _paired_layers(model, {layer: role for layer, role in roles.values()})
    names = tuple(
        name for name in dict.fromkeys(layer for layer, _ in roles.values()) if name in paired
    )
    computed = {path for path, (layer, _) in roles.items() if layer in paired}
    vocabulary = tuple(_vocabulary_parallel(model, layouts, axis, sizes)) if axis else ()
    gathered = {
        path: (dimension(v, axis), dimension(v, batch))
        for path, v in sharded.items()
        if path not in computed and path not in vocabulary
    }
    blocks, unfit = split.find_computed_blocks(model, gathered, width) if axis else ([], {})
    for kernel in (k for block in blocks for k in block.kernels if k.from_block):
        del gathered[kernel.path]  # read from the lane's block, never gathered whole
    pair_storage = {path: (dimension(sharded[path], axis), None) for path in computed}
    return TensorParallel(
        width, names, gathered, vocabulary, tuple(blocks), unfit, pair_storage=pair_storage
    )


def stage_cluster(distribution, cluster, num_stages: int, width: int, settings: dict):
    """`cluster` (the mesh's devices: `mesh_cluster`) with the devices of `num_stages`
    pipeline stages: the mesh's run stage 0 as laid out, and stage k the next group of
    batch x model devices of the worker, laid out as the mesh (the worker's devices of
    the cluster's type that the mesh does not name, in index order). Replica b's devices
    are its mesh row, then its row of each later stage: the planner cuts them into
    stages of `width` devices, lane j of the replica holding device j of every stage.

    Args:
      width: the model axis's size (`TensorParallel.width`).
      settings: {setting: value} of the run that pipelines over a mesh do not train
        (refused by name when on).

    Raises:
      ValueError: several workers, a setting in `settings` that is on, or a worker with
        fewer devices than batch x model x stages.
    """
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    refused = {name: value for name, value in settings.items() if value}
    if cluster.worker_num > 1:
        refused["workers"] = cluster.worker_num
    if refused:
        raise ValueError(
            f"Pipeline stages over a Keras layout map that shards variables (mesh {sizes}, "
            f"{num_stages} stages) run on one worker, with pipeline.virtual_stages=1 (no "
            "interleaved schedule), without zero.level, amp.level or global_clipnorm in "
            f"this version. Received: {refused}. Remove those settings, or train the layouts "
            "without stages."
        )
    mesh_devices = list(cluster.local_devices)
    prefix = mesh_devices[0].rsplit("/device:", 1)[0]
    worker = [
        f"{prefix}/device:{cluster.device_type}:{int(d.name.rsplit(':', 1)[1])}"
        for d in tf.config.list_logical_devices(cluster.device_type)
    ]
    others = [d for d in worker if d not in mesh_devices]
    size = len(mesh_devices)
    needed = size * num_stages
    if size + len(others) < needed:
        raise ValueError(
            f"A mesh {sizes} with {num_stages} pipeline stages trains on batch x model x "
            f"stages = {' x '.join(str(v) for v in sizes.values())} x {num_stages} = {needed} "
            f"devices: the mesh's {size} run stage 0 and each later stage takes {size} more "
            f"of the worker's {cluster.device_type} devices, of which it has {len(others)} "
            f"besides the mesh's ({len(worker)} in all). Received mesh devices: "
            f"{mesh_devices}"
        )
    rows = [mesh_devices[i : i + width] for i in range(0, size, width)]
    later = [others[(k - 1) * size : k * size] for k in range(1, num_stages)]
    ordered = [
        device
        for b, row in enumerate(rows)
        for device in (*row, *(d for stage in later for d in stage[b * width : (b + 1) * width]))
    ]
    return dataclasses.replace(
        cluster, local_devices=tuple(ordered), devices_by_worker=(tuple(ordered),)
    )


def _named(layout: VariableLayout) -> str:
    return f"{layout.path} {layout.shape} as {layout.axes}"


def _pair_roles(model, layouts, axis, sizes) -> dict[str, tuple[str, str]]:
    """{variable path: (Dense layer name, "column" | "row")} of the Dense layers whose
    layouts make a Megatron pair's member (an axis of size 1 shards nothing: None)."""

    def effective(path):
        return tuple(a if a is not None and sizes[a] > 1 else None for a in layouts[path].axes)

    roles = {}
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, keras.layers.Dense):
            continue
        kernel = effective(layer.kernel.path)
        bias = effective(layer.bias.path) if layer.use_bias else None
        if kernel == (None, axis) and bias in (None, (axis,)):
            role = "column"
        elif kernel == (axis, None) and bias in (None, (None,)):
            role = "row"
        else:
            continue
        roles[layer.kernel.path] = (layer.name, role)
        if bias is not None and role == "column":
            roles[layer.bias.path] = (layer.name, role)
    return roles


def _vocabulary_parallel(model, layouts, axis, sizes) -> list[str]:
    """The tables of Embedding layers laid out by vocabulary row over `axis` only
    (`(axis, None)`), which look up in place (split/layers.py `_vocab_call`); a LoRA or
    quantized Embedding's table is gathered instead."""
    found = []
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, keras.layers.Embedding) or not layer.trainable:
            continue
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            continue
        axes = layouts[layer.embeddings.path].axes
        if tuple(a if a is not None and sizes[a] > 1 else None for a in axes) == (axis, None):
            found.append(layer.embeddings.path)
    return found


def _paired_layers(model, role_of) -> set[str]:
    """The Dense layers laid out as a pair's column or row that make one
    (split/layers.py `megatron_pairs`: column layers whose outputs only the row layer
    reads, directly or through element-wise layers, each called once); the others are
    gathered on use. Each row layer is tried with the column layers alone, so a row
    reading another pair's row (a layout's next Dense) does not undo the pair."""
    by_name = {layer.name: layer for layer in model._flatten_layers(include_self=False)}
    columns = [by_name[name] for name, role in role_of.items() if role == "column"]
    found = set()
    for name in (name for name, role in role_of.items() if role == "row"):
        try:  # a layer between read from outside: no pair, gathered
            pairs = split.megatron_pairs([*columns, by_name[name]])
        except SplitError:
            continue
        for pair_columns, row in pairs:
            if row.name == name:
                found.update([name, *(c.name for c in pair_columns)])
    return found
