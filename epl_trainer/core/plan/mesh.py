"""Layout-sharded storage and tensor-parallel layers, planned as plain data (issue 47).

Keras's distribution API lays a variable out on a device mesh: `axes[d]` is the mesh axis
that dimension d is sharded over, or None (whole). Storage follows the layout exactly:
the device at mesh coordinates c holds one block of every variable, the c[axis]-th slice
of size `dim / size(axis)` along each sharded dimension. A variable sharded over no axis
is replicated, and one sharded over some axes is replicated over the others.

How each layer computes is a separate choice. A kernel whose model-axis shard fits
Megatron's column (output features) or row (contracted features) form, and which pairs
with a layer of the other form through shard-transparent code, computes sharded. Every
other sharded kernel is gathered whole before use. Batch-axis shards are storage only:
they are gathered before compute in both cases.

This module holds the arithmetic (blocks, holders, bytes per device) and the
classification (`classify_dense`, `classify_einsum`, `pairs`). It is plain Python, as is
the rest of `core/plan`, so the plan and `epl-plan` can use it without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

COLUMN, ROW, REPLICATED, GATHERED = "column", "row", "replicated", "gathered"
KINDS = (COLUMN, ROW, REPLICATED, GATHERED)


# ------------------------------------------------------------------ the mesh
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh as Keras's `DeviceMesh` describes it.

    Attributes:
      axis_names: one name per mesh axis, e.g. `("batch", "model")`.
      shape: the size of each axis.
      batch_axis: the axis the data is split over (Keras's `batch_dim_name`).
      devices: the mesh's devices flattened row-major (`np.reshape` order, as
        `DeviceMesh.devices` stores them): the last axis varies fastest.
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    batch_axis: str
    devices: tuple[str, ...]

    def __post_init__(self):
        # Keras hands lists and numpy arrays; a frozen spec keeps tuples of plain values.
        object.__setattr__(self, "axis_names", tuple(str(a) for a in self.axis_names))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))
        self._validate()

    def _validate(self) -> None:
        received = (
            f"Received: axis_names={self.axis_names}, shape={self.shape}, "
            f"batch_axis={self.batch_axis!r}, devices={self.devices}"
        )
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"A mesh needs one size per axis name. {received}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"A mesh names each axis once. {received}")
        if any(size < 1 for size in self.shape):
            raise ValueError(f"Every mesh axis has a size of at least 1. {received}")
        if math.prod(self.shape) != len(self.devices):
            raise ValueError(
                f"The mesh's shape {self.shape} holds {math.prod(self.shape)} devices, "
                f"not {len(self.devices)}. {received}"
            )
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"The mesh names a device twice. {received}")
        if self.batch_axis not in self.axis_names:
            raise ValueError(f"The batch axis is not an axis of the mesh. {received}")

    def size(self, axis: str) -> int:
        """The number of devices along `axis`."""
        return self.shape[self._axis_index(axis)]

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The axes other than the batch axis, in mesh order."""
        return tuple(a for a in self.axis_names if a != self.batch_axis)

    def coords(self, device_index: int) -> tuple[int, ...]:
        """The mesh coordinates of `devices[device_index]` (row-major)."""
        if not 0 <= device_index < len(self.devices):
            raise ValueError(
                f"The mesh has {len(self.devices)} devices. Received: device_index={device_index}"
            )
        coords = []
        for size in reversed(self.shape):
            device_index, coord = divmod(device_index, size)
            coords.append(coord)
        return tuple(reversed(coords))

    def device_index(self, coords: tuple[int, ...]) -> int:
        """The index in `devices` of the device at mesh `coords` (`coords`'s inverse)."""
        self._check_coords(coords)
        index = 0
        for coord, size in zip(coords, self.shape):
            index = index * size + coord
        return index

    def _axis_index(self, axis: str) -> int:
        if axis not in self.axis_names:
            raise ValueError(f"Mesh axes: {self.axis_names}. Received: axis={axis!r}")
        return self.axis_names.index(axis)

    def _check_coords(self, coords: tuple[int, ...]) -> None:
        if len(coords) != len(self.shape) or not all(
            0 <= c < s for c, s in zip(coords, self.shape)
        ):
            raise ValueError(
                f"Mesh coordinates are one index per axis {self.axis_names} within the "
                f"shape {self.shape}. Received: coords={tuple(coords)}"
            )


# ------------------------------------------------------------------ one variable
@dataclasses.dataclass(frozen=True)
class LaidOut:
    """A variable and its layout.

    Attributes:
      path: the variable's Keras path, `"up/kernel"`.
      shape: its shape.
      itemsize: bytes per element (4 for float32).
      axes: per dimension, the mesh axis it is sharded over, or None (whole).
    """

    path: str
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[str | None, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "axes", tuple(self.axes))

    def check(self, mesh: MeshSpec) -> None:
        """Raises a ValueError naming the variable when its layout cannot lay it out on
        `mesh`: one axis or None per dimension, axes of the mesh, each axis on one
        dimension at most (a block is one slice per axis), and every sharded dimension
        divisible by its axis's size (blocks of equal shape)."""
        laid_out = f"Variable {self.path!r} of shape {self.shape} is laid out {self.axes}"
        if len(self.axes) != len(self.shape):
            raise ValueError(
                f"{laid_out}: a layout names one mesh axis or None per dimension "
                f"({len(self.shape)})."
            )
        for dim, axis in enumerate(self.axes):
            if axis is None:
                continue
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{laid_out}: dimension {dim}'s axis {axis!r} is not a mesh axis. "
                    f"Mesh axes: {mesh.axis_names}."
                )
            if self.axes.index(axis) != dim:
                raise ValueError(
                    f"{laid_out}: mesh axis {axis!r} shards dimensions "
                    f"{self.axes.index(axis)} and {dim}; an axis shards one dimension at most."
                )
            if self.shape[dim] % mesh.size(axis):
                raise ValueError(
                    f"{laid_out}: dimension {dim} ({self.shape[dim]}) is not divisible by "
                    f"mesh axis {axis!r} of size {mesh.size(axis)}."
                )


def sharded_dimensions(
    path: str, shape: tuple[int, ...], axes: tuple, sizes: dict[str, int]
) -> tuple[int, ...]:
    """The dimensions of a variable laid out `axes` on a mesh of `sizes` that are sharded
    (over an axis of size > 1), checked against its shape: the trainer's words
    (training/keras_distribution.py) and epl-plan's (kerashub_layouts.py).

    Raises:
      ValueError: a layout of another rank, an axis the mesh lacks, or a dimension its
        axis does not divide, naming the variable, its shape, the axis and its size.
    """
    if len(axes) != len(shape):
        raise ValueError(
            f"Variable {path!r} of shape {shape} is laid out {axes}: a layout "
            f"names one mesh axis or None per dimension ({len(shape)})."
        )
    sharded = []
    for dim, axis in enumerate(axes):
        if axis is not None and axis not in sizes:
            raise ValueError(
                f"Variable {path!r} of shape {shape} is laid out {axes}: {axis!r} is not an "
                f"axis of the mesh {sizes}."
            )
        if axis is None or sizes[axis] == 1:
            continue
        if shape[dim] % sizes[axis]:
            raise ValueError(
                f"Variable {path!r} of shape {shape} is laid out {axes}: "
                f"dimension {dim} ({shape[dim]}) is not divisible by mesh axis {axis!r} "
                f"of size {sizes[axis]}."
            )
        sharded.append(dim)
    return tuple(sharded)


def block_shape(laid_out: LaidOut, mesh: MeshSpec) -> tuple[int, ...]:
    """The shape of the block each device holds: `dim / size(axis)` on sharded dims."""
    laid_out.check(mesh)
    return tuple(
        dim if axis is None else dim // mesh.size(axis)
        for dim, axis in zip(laid_out.shape, laid_out.axes)
    )


def block_slices(laid_out: LaidOut, mesh: MeshSpec, coords: tuple[int, ...]) -> tuple[slice, ...]:
    """Where, in the whole variable, the block of the device at mesh `coords` lies: the
    `coords[axis]`-th block along each sharded dimension, the whole of the others."""
    mesh._check_coords(coords)
    slices = []
    for dim, axis, block in zip(laid_out.shape, laid_out.axes, block_shape(laid_out, mesh)):
        if axis is None:
            slices.append(slice(0, dim))
        else:
            start = coords[mesh.axis_names.index(axis)] * block
            slices.append(slice(start, start + block))
    return tuple(slices)


def distinct_blocks(laid_out: LaidOut, mesh: MeshSpec) -> list[tuple[int, ...]]:
    """Mesh coordinates naming each distinct block once, row-major: every coordinate of
    the axes the variable is sharded over, 0 on the others (where the block repeats).
    Summing over these (norms, checkpoints) counts each element once."""
    laid_out.check(mesh)
    used = set(laid_out.axes)
    ranges = [range(size) if axis in used else range(1) for axis, size in mesh_axes(mesh)]
    return list(itertools.product(*ranges))


def holders(laid_out: LaidOut, mesh: MeshSpec, block_coords: tuple[int, ...]) -> list[int]:
    """The indices of the devices holding the block held at `block_coords`: those whose
    coordinates agree on the axes the variable is sharded over (the others replicate it)."""
    laid_out.check(mesh)
    mesh._check_coords(block_coords)
    used = [mesh.axis_names.index(axis) for axis in laid_out.axes if axis is not None]
    return [
        index
        for index in range(len(mesh.devices))
        if all(mesh.coords(index)[a] == block_coords[a] for a in used)
    ]


def mesh_axes(mesh: MeshSpec) -> list[tuple[str, int]]:
    """(axis name, size) of each mesh axis, in mesh order."""
    return list(zip(mesh.axis_names, mesh.shape))


def bytes_per_device(layouts: list[LaidOut], mesh: MeshSpec) -> dict[str, int]:
    """{device: bytes of model variables it holds}: each variable's block (the whole
    variable when it is replicated). Known from the layouts alone, before anything is
    built. Every device holds one block of every variable, hence equal bytes."""
    held = sum(math.prod(block_shape(v, mesh)) * v.itemsize for v in layouts)
    return dict.fromkeys(mesh.devices, held)


# ------------------------------------------------------------------ how a layer computes
def classify_dense(kernel_axes: tuple[str | None, ...], model_axis: str) -> str:
    """How a Dense layer with this kernel layout (in, out) computes over `model_axis`.

    "column": the model axis shards the output features; "row": it shards the input
    features; "replicated": the kernel is laid out whole; "gathered": the kernel is
    sharded, but not over the model axis (storage only), so it is gathered whole.
    Shards over other axes (the batch axis) are gathered before compute in every case.
    A Dense is the EinsumDense `bi,io->bo`.
    """
    if len(kernel_axes) != 2:
        raise ValueError(
            f"A Dense kernel has 2 dimensions (in, out). Received: kernel_axes={kernel_axes}"
        )
    return classify_einsum("bi,io->bo", kernel_axes, model_axis)


def classify_einsum(equation: str, kernel_axes: tuple[str | None, ...], model_axis: str) -> str:
    """How an EinsumDense layer computes over `model_axis`, from its equation
    (`"input,kernel->output"`, as `"btd,ndh->btnh"`) and kernel layout.

    The kernel letter carrying the model axis decides: in the output and not the input
    (new features, such as heads) is "column"; contracted (in the input and the kernel,
    not the output) is "row". No model axis is "replicated" when the kernel is laid out
    whole, else "gathered" (sharded for storage only). A model-axis letter elsewhere
    (kept from the input into the output, or summed over the kernel alone) has no
    Megatron form: "gathered".
    """
    inputs, kernel, output = _einsum_parts(equation)
    if len(kernel) != len(kernel_axes):
        raise ValueError(
            f"The kernel of {equation!r} has {len(kernel)} dimensions ({kernel!r}), the "
            f"layout {len(kernel_axes)}. Received: kernel_axes={kernel_axes}"
        )
    if model_axis not in kernel_axes:
        return REPLICATED if all(axis is None for axis in kernel_axes) else GATHERED
    letter = kernel[kernel_axes.index(model_axis)]
    if letter in output and letter not in inputs:
        return COLUMN
    if letter in inputs and letter not in output:
        return ROW
    return GATHERED


def _einsum_parts(equation: str) -> tuple[str, str, str]:
    """(input, kernel, output) letters of an EinsumDense equation; the input's and
    output's `...` (leading batch dimensions) carry no kernel letter and are dropped."""
    operands, arrow, output = equation.replace(" ", "").partition("->")
    parts = operands.split(",")
    if not arrow or len(parts) != 2 or "." in parts[1]:
        raise ValueError(
            "An EinsumDense equation reads 'input,kernel->output', with no '...' in the "
            f"kernel. Received: equation={equation!r}"
        )
    return parts[0].replace("...", ""), parts[1], output.replace("...", "")


# ------------------------------------------------------------------ Megatron pairs
@dataclasses.dataclass(frozen=True)
class Pairing:
    """Which column and row layers compute sharded.

    Attributes:
      pairs: (column layer, row layer) for each column output a row layer reads, in the
        row layers' order. A row layer reading several columns (gate * up -> down) has
        one pair per column.
      gathered: {layer: why} for each column or row layer that does not pair, so is
        gathered whole and computed on every device of its tensor-parallel group.
    """

    pairs: tuple[tuple[str, str], ...]
    gathered: dict[str, str]


def pairs(layers: list[tuple[str, str, str | tuple[str, ...] | None, bool]]) -> Pairing:
    """Megatron pairs among `layers`.

    A column layer's output is sharded over the model axis, and a row layer reads such a
    shard and sums the partial products (one all-reduce). Between them, code must act on
    each shard alone (elementwise activations, dropout, the product of two shards): it is
    "shard-transparent". So a column layer computes sharded when every layer reading it
    is a row layer through transparent code, and a row layer when every input it reads
    comes from such a column layer. Removing one layer can unpair its partners, so the
    check repeats until nothing changes.

    Args:
      layers: `(name, kind, source, transparent)` per layer, in model order. `kind` is
        one of `KINDS` (`classify_dense` / `classify_einsum`'s answer; a layer without a
        kernel, or the model's output, is "replicated"). `source` names the layer(s)
        whose output this layer reads (None: the model's input); `transparent` says
        whether the code between the source(s) and this layer is shard-transparent.
        Every reader of a column layer's output must be listed, so that a shard reaching
        anything else (a softmax, the model's output) unpairs it.

    Returns:
      A `Pairing`. Layers of kind "replicated" or "gathered" appear in neither field.
    """
    facts = [_fact(entry) for entry in layers]
    kinds = {name: kind for name, kind, _, _ in facts}
    if len(kinds) != len(facts):
        names = [name for name, _, _, _ in facts]
        raise ValueError(f"Each layer is listed once. Received names: {names}")
    readers = {name: [f for f in facts if name in f[2]] for name in kinds}
    gathered: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, kind, sources, transparent in facts:
            if kind not in (COLUMN, ROW) or name in gathered:
                continue
            if kind == COLUMN:
                reason = _column_unpaired(readers[name], gathered)
            else:
                reason = _row_unpaired(sources, transparent, kinds, gathered)
            if reason:
                gathered[name] = reason
                changed = True
    paired = tuple(
        (source, name)
        for name, kind, sources, _ in facts
        if kind == ROW and name not in gathered
        for source in sources
    )
    return Pairing(paired, gathered)


def _fact(entry) -> tuple[str, str, tuple[str, ...], bool]:
    """One `pairs` entry, checked, with its sources as a tuple."""
    name, kind, source, transparent = entry
    if kind not in KINDS:
        raise ValueError(f"Layer {name!r}: kind is one of {KINDS}. Received: kind={kind!r}")
    sources = () if source is None else (source,) if isinstance(source, str) else tuple(source)
    return name, kind, sources, bool(transparent)


def _column_unpaired(readers, gathered: dict[str, str]) -> str:
    """Why a column layer with these readers cannot keep its output sharded ("": it can)."""
    if not readers:
        return "its output reaches no row layer"
    for name, kind, _, transparent in readers:
        if kind != ROW:
            return f"its output reaches {name!r} ({kind}), not a row layer"
        if not transparent:
            return (
                f"its output reaches row layer {name!r} through code that is not shard-transparent"
            )
        if name in gathered:
            return f"row layer {name!r}, which reads it, is gathered"
    return ""


def _row_unpaired(sources, transparent: bool, kinds: dict[str, str], gathered) -> str:
    """Why a row layer reading `sources` cannot take sharded input ("": it can)."""
    if not sources:
        return "its input is the model's input, not a column layer's output"
    for source in sources:
        if kinds.get(source) != COLUMN:
            kind = kinds.get(source, "not a listed layer")
            return f"its input comes from {source!r} ({kind}), not a column layer"
        if not transparent:
            return f"its input comes from {source!r} through code that is not shard-transparent"
        if source in gathered:
            return f"column layer {source!r}, which it reads, is gathered"
    return ""
