"""KerasHub's decoder-only families by their sizes, and what each device holds under a
layout.

`variables(family, sizes)` lists a backbone's model variables, (path, shape), exactly as
KerasHub 0.32 builds and names them (`keras_hub/src/models/{llama,gemma,qwen}/`): pure
Python, so a 7B model is described without building it. `place` divides each variable
over the mesh axes its layout names, as `EPLTrainer.placement()` reports storage
(training/keras_distribution.py, `variable_layouts`). The layouts come from KerasHub's
own `get_layout_map` (runtime/kerashub_maps.py, which imports keras: this module never
does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from epl_trainer.core.plan import mesh as mesh_plan

FLOAT32_BYTES = 4  # KerasHub's backbones hold float32 variables unless given another dtype
MESH_AXES = ("batch", "model")  # the axis names KerasHub's get_layout_map defaults to


@dataclasses.dataclass(frozen=True)
class DecoderSizes:
    """A decoder-only backbone's constructor sizes, by KerasHub's argument names:
    `intermediate` is `intermediate_dim` (Gemma's two gates are half of it each, as
    KerasHub builds them), `head_dim` is Gemma's (Llama and Qwen use hidden // heads),
    `tie_embeddings` None takes the family's default."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    tie_embeddings: bool | None = None

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1. Received: {name}={value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                "Query heads share key/value heads in equal groups: heads must be a multiple "
                f"of kv_heads. Received: heads={self.heads}, kv_heads={self.kv_heads}"
            )


Shape = tuple[int, ...]
Variables = list[tuple[str, Shape]]


def _embeddings(sizes: DecoderSizes, tied: bool) -> Variables:
    """ReversibleEmbedding's table, and its separate output projection when untied."""
    table = [("token_embedding/embeddings", (sizes.vocab, sizes.hidden))]
    if not tied:
        table.append(("token_embedding/reverse_embeddings", (sizes.hidden, sizes.vocab)))
    return table


def _llama_like_layer(i: int, sizes: DecoderSizes, qkv_bias: bool) -> Variables:
    """LlamaTransformerDecoder / QwenTransformerDecoder: EinsumDense query/key/value
    `bqm,muh->bquh` (Qwen adds biases over `uh`), a SwiGLU MLP of three bias-free Dense."""
    head_dim = sizes.hidden // sizes.heads  # LlamaAttention / QwenAttention
    h, f = sizes.hidden, sizes.intermediate
    prefix = f"transformer_layer_{i}"
    attention = f"{prefix}/self_attention"
    out = []
    for name, heads in (("query", sizes.heads), ("key", sizes.kv_heads),
                        ("value", sizes.kv_heads)):  # fmt: skip
        out.append((f"{attention}/{name}/kernel", (h, heads, head_dim)))
        if qkv_bias:
            out.append((f"{attention}/{name}/bias", (heads, head_dim)))
    out += [
        (f"{attention}/attention_output/kernel", (sizes.heads, head_dim, h)),
        (f"{prefix}/self_attention_layernorm/scale", (h,)),
        (f"{prefix}/feedforward_intermediate_dense/kernel", (h, f)),
        (f"{prefix}/feedforward_gate_dense/kernel", (h, f)),
        (f"{prefix}/feedforward_output_dense/kernel", (f, h)),
        (f"{prefix}/feedforward_layernorm/scale", (h,)),
    ]
    return out


def _llama_like(sizes: DecoderSizes, tied: bool, qkv_bias: bool) -> Variables:
    if sizes.head_dim is not None and sizes.head_dim != sizes.hidden // sizes.heads:
        raise ValueError(
            "Llama's and Qwen's heads are hidden // heads wide; head_dim is Gemma's size. "
            f"Received: head_dim={sizes.head_dim}, hidden={sizes.hidden}, heads={sizes.heads}"
        )
    out = _embeddings(sizes, tied)
    for i in range(sizes.layers):
        out += _llama_like_layer(i, sizes, qkv_bias)
    return [*out, ("sequence_output_layernorm/scale", (sizes.hidden,))]


def _gemma(sizes: DecoderSizes, tied: bool, qkv_bias: bool) -> Variables:
    """GemmaBackbone with its defaults (no post-attention / post-FFW norms): query/key/value
    `btd,ndh->btnh` kernels (heads, hidden, head_dim), gates of intermediate // 2."""
    if sizes.head_dim is None:
        raise ValueError("Gemma's head_dim is a size of its own: give head_dim.")
    h, d, gate = sizes.hidden, sizes.head_dim, sizes.intermediate // 2
    out = _embeddings(sizes, tied)
    for i in range(sizes.layers):
        block = f"decoder_block_{i}"
        out += [
            (f"{block}/pre_attention_norm/scale", (h,)),
            (f"{block}/attention/query/kernel", (sizes.heads, h, d)),
            (f"{block}/attention/key/kernel", (sizes.kv_heads, h, d)),
            (f"{block}/attention/value/kernel", (sizes.kv_heads, h, d)),
            (f"{block}/attention/attention_output/kernel", (sizes.heads, d, h)),
            (f"{block}/pre_ffw_norm/scale", (h,)),
            (f"{block}/ffw_gating/kernel", (h, gate)),
            (f"{block}/ffw_gating_2/kernel", (h, gate)),
            (f"{block}/ffw_linear/kernel", (gate, h)),
        ]
    return [*out, ("final_normalization/scale", (h,))]


@dataclasses.dataclass(frozen=True)
class Family:
    """A KerasHub family: its backbone class (`keras_hub.models.<backbone>`), its
    variables, whether its embeddings are tied by default and whether it may untie them."""

    backbone: str
    build: Callable[[DecoderSizes, bool, bool], Variables]
    tied_by_default: bool
    may_untie: bool = True
    qkv_bias: bool = False


FAMILIES = {
    "llama": Family("LlamaBackbone", _llama_like, tied_by_default=False),
    "gemma": Family("GemmaBackbone", _gemma, tied_by_default=True, may_untie=False),
    "qwen": Family("QwenBackbone", _llama_like, tied_by_default=True, qkv_bias=True),
}


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"Unknown KerasHub family. Expected one of {sorted(FAMILIES)}. "
                         f"Received: {name!r}")  # fmt: skip
    return FAMILIES[name]


def variables(family: str, sizes: DecoderSizes) -> Variables:
    """[(path, shape)] of the family's backbone's model variables, as KerasHub names them."""
    spec = _family(family)
    tied = spec.tied_by_default if sizes.tie_embeddings is None else sizes.tie_embeddings
    if not tied and not spec.may_untie:
        raise ValueError(f"KerasHub's {spec.backbone} always ties its embeddings. "
                         f"Received: tie_embeddings={sizes.tie_embeddings}")  # fmt: skip
    return spec.build(sizes, tied, spec.qkv_bias)


def check_mesh(mesh_shape) -> tuple[int, int]:
    shape = tuple(mesh_shape)
    if len(shape) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                              for n in shape):  # fmt: skip
        raise ValueError(
            f"A mesh is (batch, model) sizes, two ints >= 1. Received: mesh={mesh_shape!r}"
        )
    return shape


def device_names(mesh_shape) -> list[str]:
    """The mesh's devices, in Keras's order (row-major over (batch, model))."""
    return [f"gpu:{i}" for i in range(math.prod(check_mesh(mesh_shape)))]


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    path: str
    shape: Shape
    axes: tuple | None  # the layout's mesh axis per dimension; None: replicated
    bytes: int  # the whole variable
    bytes_per_device: int  # the piece each device holds


@dataclasses.dataclass(frozen=True)
class Placement:
    """Each variable's piece per device; every device of the mesh holds the same bytes
    (a layout shards only dimensions its axes divide, into equal pieces)."""

    family: str
    mesh: tuple[int, int]
    variables: tuple[VariablePlacement, ...]

    @property
    def devices(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def model_bytes(self) -> int:
        return sum(v.bytes for v in self.variables)

    @property
    def parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables)

    @property
    def bytes_per_device(self) -> int:
        """Model variables held per device: what `EPLTrainer.placement()` gives."""
        return sum(v.bytes_per_device for v in self.variables)

    def states_per_device(self, optimizer_slots: int) -> dict[str, int]:
        """{variables, gradients, optimizer, total} bytes per device: the gradients and
        each of the optimizer's slots are laid out as their variable (the optimizer's
        scalar counters, a few bytes, are left out)."""
        held = self.bytes_per_device
        states = {"variables": held, "gradients": held, "optimizer": optimizer_slots * held}
        return {**states, "total": sum(states.values())}

    def to_dict(self, optimizer_slots: int) -> dict:
        return {
            "family": self.family,
            "mesh": list(self.mesh),
            "mesh_axes": list(MESH_AXES),
            "parameters": self.parameters,
            "model_bytes": self.model_bytes,
            "bytes_per_device": self.bytes_per_device,
            "placement": {name: self.bytes_per_device for name in device_names(self.mesh)},
            "states_per_device": self.states_per_device(optimizer_slots),
            "variables": [
                {"path": v.path, "shape": list(v.shape),
                 "layout": None if v.axes is None else list(v.axes), "bytes": v.bytes,
                 "bytes_per_device": v.bytes_per_device}
                for v in self.variables
            ],
        }  # fmt: skip


def _piece(path: str, shape: Shape, axes: tuple | None, sizes: dict[str, int]) -> int:
    """The divisor of a variable's bytes on each device, checked as the trainer checks
    (`mesh.sharded_dimensions`, the trainer's words)."""
    if axes is None:
        return 1
    divisor = 1
    for dim in mesh_plan.sharded_dimensions(path, tuple(shape), tuple(axes), sizes):
        divisor *= sizes[axes[dim]]
    return divisor


def place(
    family: str,
    listed: Variables,
    layout_of: Callable[[str], tuple | None],
    mesh_shape,
    value_bytes: int = FLOAT32_BYTES,
) -> Placement:
    """The bytes of each of `listed`'s variables that each device of `mesh_shape` holds
    under `layout_of` (e.g. runtime/kerashub_maps.py's `kerashub_layout`)."""
    mesh = check_mesh(mesh_shape)
    sizes = dict(zip(MESH_AXES, mesh))
    placed = []
    for path, shape in listed:
        axes = layout_of(path)
        whole = math.prod(shape) * value_bytes
        placed.append(
            VariablePlacement(path, shape, axes, whole, whole // _piece(path, shape, axes, sizes))
        )
    return Placement(family, mesh, tuple(placed))
