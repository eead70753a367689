"""Tensor parallelism inside KerasHub's decoder blocks: attention by heads, the MLP as a
Megatron pair, computed on each lane's shards of the kernels a Keras layout map lays out
over the model axis.

KerasHub's transformers are subclassed layers, so the functional-graph search for
Megatron pairs (`layers.megatron_pairs`) cannot see inside them. This module knows the
blocks of the KerasHub families that ship layout maps (Llama, Qwen, Gemma): for each
class (`ATTENTIONS`, `MLPS`) its sub-layer attributes, einsum equations and the kernel
dimension a lane's share is taken along. It computes a block sharded when every kernel
of it is laid out over the model axis:

* **Attention by heads.** The lane all-gathers the replica's rows of the hidden states
  (and of the attention mask), computes query, key and value for its heads only, runs
  the block's own attention core on them (its head counts divided by the model axis's
  size while the lane traces), and multiplies its heads' part of the output projection:
  a reduce-scatter sums the lanes' partial outputs and hands each lane its own rows.
* **The MLP** (gate and up, then down): the lane all-gathers the replica's rows once for
  both column layers, computes its slice of the intermediate units, and its partial sum
  of the down projection, reduce-scattered back to its own rows.

Per block and micro-batch that is one all-gather and one reduce-scatter of the rows
forward and their adjoints backward: the bytes of Megatron-LM's one all-reduce each way,
with each lane keeping its own rows between blocks (sequence-parallel style, as the
functional pairs in `layers.py` do).

A kernel is read from the lane's block when the layout shards it along the dimension the
lane computes (Gemma's query heads, Llama's MLP and output projection): gathered over
the batch axis only, never over the model axis. A kernel laid out along another
dimension (Llama's query, key and value, whose map shards the hidden dimension) is held
as its block and gathered whole on use as before, and the lane computes its heads from
the whole. Either way the gradient of each lane's share reaches the block that holds it
(the gathers' adjoints), and the step is the replicated one.

A block that does not qualify (another class, a LoRA or quantized sub-layer, a bias this
module does not know how to share, an einsum equation other than the one it knows, a
head count the axis does not divide, a kernel not laid out over the model axis) is left
to the gathered path, and the plan says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import keras
import tensorflow as tf

from epl_trainer.core.engine.split.blocks import LaidOutVariable, _slice


@dataclasses.dataclass(frozen=True)
class Member:
    """A sub-layer of a block: its attribute, its einsum equation (None: a Dense), the
    kernel dimension a lane's share is taken along, and its role."""

    attribute: str
    equation: str | None
    dim: int
    role: str  # "column": a share of its outputs; "row": a partial sum over its inputs
    # A column's bias dimension along which the lane takes its share (None: the member
    # has no bias). A row's bias is added whole after the sum, as Megatron adds it.
    bias_dim: int | None = None


@dataclasses.dataclass(frozen=True)
class Adapter:
    """What the engine needs to know of one KerasHub block class."""

    kind: str  # "attention" or "mlp"
    members: tuple[Member, ...]
    # Attributes the block's own code reads as head counts (divided by the axis's size
    # while a lane traces), and others kept in proportion to them.
    heads: tuple[str, ...] = ()


_LLAMA_ATTENTION = Adapter(
    "attention",
    (
        Member("_query_dense", "bqm,muh->bquh", 1, "column"),
        Member("_key_dense", "bkm,mvh->bkvh", 1, "column"),
        Member("_value_dense", "bkm,mvh->bkvh", 1, "column"),
        Member("_output_dense", "bquh,uhm->bqm", 0, "row"),
    ),
    heads=("num_query_heads", "num_key_value_heads"),
)
_GEMMA_ATTENTION = Adapter(
    "attention",
    (
        Member("query_dense", "btd,ndh->btnh", 0, "column"),
        Member("key_dense", "bsd,kdh->bskh", 0, "column"),
        Member("value_dense", "bsd,kdh->bskh", 0, "column"),
        Member("output_dense", "btnh,nhd->btd", 0, "row"),
    ),
    # `hidden_dim // num_query_heads` scales the scores when query_head_dim_normalize is
    # off: both shrink together.
    heads=("num_query_heads", "num_key_value_heads", "hidden_dim"),
)
# Qwen's attention is Llama's with biases on query, key and value (shaped (heads,
# head_dim): bias_axes "uh" / "vh"), shared by heads.
_QWEN_ATTENTION = dataclasses.replace(
    _LLAMA_ATTENTION,
    members=tuple(
        dataclasses.replace(m, bias_dim=0) if m.role == "column" else m
        for m in _LLAMA_ATTENTION.members
    ),
)
_LLAMA_MLP = Adapter(
    "mlp",
    (
        Member("_feedforward_gate_dense", None, 1, "column"),
        Member("_feedforward_intermediate_dense", None, 1, "column"),
        Member("_feedforward_output_dense", None, 0, "row"),
    ),
)
ATTENTIONS = {
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": _LLAMA_ATTENTION,
    "keras_hub.src.models.qwen.qwen_attention.QwenAttention": _QWEN_ATTENTION,
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention": _GEMMA_ATTENTION,
}
MLPS = {
    "keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder": _LLAMA_MLP,
    "keras_hub.src.models.qwen.qwen_decoder.QwenTransformerDecoder": _LLAMA_MLP,
    "keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock": Adapter(
        "mlp",
        (
            Member("gating_ffw", "btd,df->btf", 1, "column"),
            Member("gating_ffw_2", "btd,df->btf", 1, "column"),
            Member("ffw_linear", "btf,fd->btd", 0, "row"),
        ),
    ),
}


def adapter_of(layer) -> Adapter | None:
    cls = type(layer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return ATTENTIONS.get(name) or MLPS.get(name)


@dataclasses.dataclass(frozen=True)
class ComputedKernel:
    """A kernel of a computed block: its variable path, its member, and where the lane's
    share comes from (`from_block`: the lane's own block, gathered over the batch axis
    only; else the whole, gathered on use)."""

    path: str
    member: Member
    # The layout's storage: (dimension over the model axis, over the batch axis or None).
    storage: tuple[int, int | None]

    @property
    def from_block(self) -> bool:
        return self.storage[0] == self.member.dim


@dataclasses.dataclass(frozen=True)
class ComputedBlock:
    """A KerasHub block computed tensor parallel (pure data: the plan's)."""

    path: str  # the layer's path
    kind: str
    kernels: tuple[ComputedKernel, ...]

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"{self.path} (MLP)"
        whole = [k.path.split("/")[-2] for k in self.kernels if not k.from_block]
        note = f"; {', '.join(whole)} from the gathered whole" if whole else ""
        return f"{self.path} (attention by heads{note})"


def find_computed_blocks(
    model, storage_of, width: int
) -> tuple[list[ComputedBlock], dict[str, str]]:
    """The blocks of `model` computed tensor parallel over `width` lanes, and
    {layer path: why not} for the known blocks that are not.

    Args:
      storage_of: {variable path: (the dimension its layout shards over the model axis,
        over the batch axis)} of the sharded variables.
    """
    model_dim_of = {path: dims[0] for path, dims in storage_of.items()}
    found, refused = [], {}
    for layer in model._flatten_layers(include_self=False):
        adapter = adapter_of(layer)
        if adapter is None:
            continue
        reason = _unfit(layer, adapter, model_dim_of, width)
        if reason:
            refused[layer.path] = reason
            continue
        kernels = []
        for member in adapter.members:
            path = getattr(layer, member.attribute).kernel.path
            kernels.append(ComputedKernel(path, member, storage_of[path]))
        found.append(ComputedBlock(layer.path, adapter.kind, tuple(kernels)))
    return found, refused


def _unfit(layer, adapter: Adapter, model_dim_of, width: int) -> str | None:
    """Why `layer` is not computed tensor parallel (None: it is)."""
    for name in adapter.heads:
        if getattr(layer, name) % width:
            return f"{name}={getattr(layer, name)} is not divisible by the model axis ({width})"
    for member in adapter.members:
        sub = getattr(layer, member.attribute, None)
        expected = keras.layers.Dense if member.equation is None else keras.layers.EinsumDense
        if not isinstance(sub, expected):
            return f"{member.attribute} is not a {expected.__name__}"
        if member.equation is not None and sub.equation != member.equation:
            return f"{sub.path} computes {sub.equation!r}, not {member.equation!r}"
        has_bias = getattr(sub, "bias", None) is not None
        if has_bias and member.role == "column" and member.bias_dim is None:
            return f"{sub.path} has a bias"
        if has_bias and member.role == "column" and sub.bias.shape[member.bias_dim] % width:
            return (
                f"{sub.bias.path} {tuple(sub.bias.shape)}: dimension {member.bias_dim} is not "
                f"divisible by the model axis ({width})"
            )
        if getattr(sub, "lora_enabled", False) or getattr(sub, "quantization_mode", None):
            return f"{sub.path} is LoRA or quantized"
        if model_dim_of.get(sub.kernel.path) is None:
            return f"{sub.kernel.path} is not laid out over the model axis"
        if sub.kernel.shape[member.dim] % width:
            return (
                f"{sub.kernel.path} {tuple(sub.kernel.shape)}: dimension {member.dim} is not "
                f"divisible by the model axis ({width})"
            )
        if member.role == "column" and _is_softmax(sub):
            return f"{sub.path} has a softmax activation"
    return None


def _is_softmax(layer) -> bool:
    return getattr(layer.activation, "__name__", "") == "softmax"


# ---- the lane's computation -------------------------------------------------------------


def block_call(layer, block: ComputedBlock, specs, shards, lane_comm, batch_comm):
    """`layer.call` for one lane: the block's own code, its members computing the lane's
    share (see the module doc).

    Args:
      specs, shards: the storage specs and raw block values of `block`'s kernels read
        from the lane's block (`from_block`), in the block's kernel order.
    """
    adapter = adapter_of(layer)
    own = dict(zip([k.path for k in block.kernels if k.from_block], zip(specs, shards)))
    width = lane_comm.size

    def share(kernel: ComputedKernel):
        sub = getattr(layer, kernel.member.attribute)
        if kernel.path in own:
            spec, value = own[kernel.path]
            if isinstance(spec, LaidOutVariable):
                return spec.gather_batch(value, batch_comm)
            return value
        # The whole kernel, gathered on use into the call's variable mapping.
        return _slice(sub.kernel.value, kernel.member.dim, width, lane_comm.rank)

    original = type(layer).call
    signature = inspect.signature(original)

    if block.kind == "attention":

        def call(*args, **kwargs):
            bound = signature.bind(layer, *args, **kwargs)
            arguments = bound.arguments
            if arguments.get("cache") is not None:
                raise ValueError(
                    f"{layer.path} was called with a cache (generation), which its "
                    "tensor-parallel training adapter does not run."
                )
            names = list(signature.parameters)
            hidden = names[1]
            arguments[hidden] = lane_comm.gather_rows(arguments[hidden])
            if arguments.get("attention_mask") is not None:
                arguments["attention_mask"] = _gather_mask(arguments["attention_mask"], lane_comm)
            calls = {
                k.member.attribute: _member_call(layer, k, share(k), lane_comm, gather=None)
                for k in block.kernels
            }
            with _local(layer, adapter.heads, width), _replaced(layer, calls):
                return original(*bound.args, **bound.kwargs)

        return call

    def call(*args, **kwargs):
        gathered = {}

        def gather(x):  # once per input: gate and up read the same rows
            key = x.ref()
            if key not in gathered:
                gathered[key] = lane_comm.gather_rows(x)
            return gathered[key]

        calls = {
            k.member.attribute: _member_call(layer, k, share(k), lane_comm, gather)
            for k in block.kernels
        }
        with _replaced(layer, calls):
            return original(layer, *args, **kwargs)

    return call


def _member_call(layer, kernel: ComputedKernel, value, lane_comm, gather):
    """A member's `call`: a column computes its share of the outputs (of every row of
    the replica, gathered by `gather` when given); a row its partial sum, summed over
    the lanes and scattered back to the lane's rows."""
    sub = getattr(layer, kernel.member.attribute)
    equation = kernel.member.equation

    def call(inputs, training=None):
        if kernel.member.role == "column" and gather is not None:
            inputs = gather(inputs)
        local = tf.cast(value, inputs.dtype)
        if equation is None:
            outputs = keras.ops.matmul(inputs, local)
        else:
            outputs = keras.ops.einsum(equation, inputs, local)
        if kernel.member.role == "row":
            outputs = lane_comm.reduce_scatter_rows(outputs)
        if getattr(sub, "bias", None) is not None:  # read whole from the call's mapping
            bias = sub.bias.value
            if kernel.member.role == "column":
                bias = _slice(bias, kernel.member.bias_dim, lane_comm.size, lane_comm.rank)
            outputs = outputs + tf.cast(bias, outputs.dtype)
        return sub.activation(outputs) if sub.activation is not None else outputs

    return call


def _gather_mask(mask, lane_comm):
    """Every lane's rows of an attention mask (no gradient)."""
    if mask.dtype == tf.bool:
        return tf.cast(lane_comm.gather_rows(tf.cast(mask, tf.int32)), tf.bool)
    return tf.stop_gradient(lane_comm.gather_rows(tf.stop_gradient(mask)))


@contextlib.contextmanager
def _local(layer, names, width: int):
    """The block's head counts (and what scales with them) divided by `width`."""
    saved = {name: getattr(layer, name) for name in names}
    try:
        for name, value in saved.items():
            object.__setattr__(layer, name, value // width)
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(layer, name, value)


@contextlib.contextmanager
def _replaced(layer, calls: dict):
    """Sub-layers' `call` replaced (and their input specs lifted: a row's input is the
    lane's share of its features)."""
    subs = [(getattr(layer, attribute), fn) for attribute, fn in calls.items()]
    specs = [(sub, sub.input_spec) for sub, _ in subs]
    try:
        for sub, fn in subs:
            object.__setattr__(sub, "call", fn)
            object.__setattr__(sub, "input_spec", None)
        yield
    finally:
        for sub, _ in subs:
            object.__delattr__(sub, "call")
        for sub, spec in specs:
            object.__setattr__(sub, "input_spec", spec)
