"""Keras's distribution API (`keras.distribution`) through EPLTrainer on TensorFlow.

Keras defines one distribution API (`DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`, `set_distribution`, `Distribution.scope()`), which its TensorFlow backend
does not run: a model trains replicated on one device. EPLTrainer follows it: a
distribution given as `strategy=`, or the one set or in scope when the trainer is made,
lays out the run.

- The mesh's devices are the run's devices, in the mesh's order (Keras's names,
  `"cpu:3"` / `"gpu:1"`, or TensorFlow's); with several workers, each worker's mesh is its
  own devices and the batch axis extends over the workers, as `TF_CONFIG` describes them.
- The batch axis (`batch_dim_name`) is the data-parallel lanes.
- Each variable's layout is Keras's own answer (`Distribution.get_variable_layout`: an
  explicit layout, else the `LayoutMap`'s exact key, else its one `re.fullmatch`, two
  matches being Keras's error). A layout must fit the variable: its rank, and every
  sharded dimension divisible by its mesh axis (else an error naming the variable, its
  shape, the axis and its size).

What runs in this version: data parallelism over every mesh device, whenever no variable
is sharded (a `DataParallel`; a `ModelParallel` whose map shards nothing, such as a model
axis of size 1). Every device then computes the same step Keras's `DataParallel` does: the
mean gradient of the global batch. A layout that shards a variable over an axis of size > 1
(tensor parallelism, or storage sharded over the batch axis) and a layout of layer
outputs are refused by name rather than trained replicated.
"""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

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
    """`cluster` with the mesh's devices as every worker's devices, in the mesh's order.

    Raises:
      ValueError: a mesh device this worker does not have, or of another type than the
        cluster's devices (a "cpu" mesh on a GPU worker).
    """
    names = [str(name) for name in np.asarray(distribution.device_mesh.devices).reshape(-1)]
    available = {
        (device.device_type.upper(), int(device.name.rsplit(":", 1)[1]))
        for device in tf.config.list_logical_devices()
    }
    indices = []
    for name in names:
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
        indices.append(int(match["index"]))
    if len(set(indices)) != len(indices):
        raise ValueError(f"The mesh names a device twice. Received mesh devices: {names}")

    def on_worker(worker: int) -> tuple[str, ...]:
        prefix = cluster.devices_by_worker[worker][0].rsplit("/device:", 1)[0]
        return tuple(f"{prefix}/device:{cluster.device_type}:{i}" for i in indices)

    by_worker = tuple(on_worker(w) for w in range(cluster.worker_num))
    return dataclasses.replace(
        cluster, local_devices=by_worker[cluster.worker_index], devices_by_worker=by_worker
    )


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
        if len(axes) != len(shape):
            raise ValueError(
                f"Variable {variable.path!r} of shape {shape} is laid out {axes}: a layout "
                f"names one mesh axis or None per dimension ({len(shape)})."
            )
        sharded = []
        for dim, axis in enumerate(axes):
            if axis is None or sizes[axis] == 1:
                continue
            if shape[dim] % sizes[axis]:
                raise ValueError(
                    f"Variable {variable.path!r} of shape {shape} is laid out {axes}: "
                    f"dimension {dim} ({shape[dim]}) is not divisible by mesh axis {axis!r} "
                    f"of size {sizes[axis]}."
                )
            sharded.append(dim)
        layouts.append(VariableLayout(variable.path, shape, axes, tuple(sharded)))
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


def check_runnable(distribution, model) -> None:
    """Raises a ValueError naming what this version does not train: a variable sharded
    over a mesh axis of size > 1, or a layout of layer outputs."""
    layouts = variable_layouts(distribution, model)
    sharded = [f"{v.path} {v.shape} as {v.axes}" for v in layouts if v.sharded]
    mesh = distribution.device_mesh
    if sharded:
        raise ValueError(
            f"{type(distribution).__name__} on mesh {dict(zip(mesh.axis_names, mesh.shape))} "
            f"shards {len(sharded)} variable(s) over an axis of size > 1: "
            f"{sharded[:6]}{' ...' if len(sharded) > 6 else ''}. EPLTrainer trains Keras "
            "distributions whose variables are replicated (DataParallel, or a layout map that "
            "shards nothing) in this version; tensor parallelism of a layout map is not "
            "built yet (epl.split splits a classifier and MoE experts)."
        )
    outputs = output_layouts(distribution, model)
    if outputs:
        raise ValueError(
            "Layouts of layer outputs are not applied on TensorFlow (Keras's Layer relayouts "
            f"them with the backend's distribute_tensor, which TensorFlow lacks). Received: "
            f"{outputs}"
        )
