"""Models described by their sizes alone, as `estimate.ModelCost`s (no TensorFlow).

`epl-plan` estimates models far larger than this machine can build, so their costs come
from formulas rather than from a Keras graph (`core/graph/cost.py` does that for models that
exist). Every node is a whole block (embedding, one transformer layer, one ResNet
bottleneck block, the head), and stages may start at any block boundary, as the
automatic partition cuts between repeated blocks.

Activations kept for backward per transformer layer and sample, in elements, counted
from the tensors TensorFlow's gradients of Keras's layers keep (s = sequence length,
h = hidden size, f = feed-forward size, a = heads):

* 10 s*h: each LayerNormalization's input and normalising factor (2 x 2), the
  attention input, the scaled query, key and value (4), the attention context (1) and
  the feed-forward input (1);
* a*s^2: the attention probabilities (softmax output);
* 4 s*f with GELU (Keras's exact erf form keeps x/sqrt(2), 1+erf(.), x/2 and the
  output), 5 with its tanh approximation (BERT's: x, tanh(.), 1+tanh(.), x/2 and the
  output), 1 s*f with ReLU (its output).

Under AMP these are 16-bit except the LayerNormalizations' 4 s*h, which Keras computes
in at least float32 (`NodeCost.float32_bytes`). Under tensor parallelism (Megatron's
column / row pairs) every rank keeps 6 s*h of them whole (the normalisations' inputs and
factors, the attention and feed-forward inputs); the rest splits.

Elementwise traffic per layer and sample (`NodeCost.elementwise_bytes`: elements each
forward reads plus writes, what `step_time.py` divides by the memory bandwidth), counted
op by op as Keras runs them: the two LayerNormalizations 3 s*h each and the two residual
adds 3 s*h each, the query scaling and the six bias adds 12 s*h (the output and
down-projection biases after the rank's all-reduce, 4 s*h of it whole on every rank),
the softmax 3 a*s^2, and the feed-forward activation with its bias add: 12 s*f (GELU),
14 (tanh GELU), 4 (ReLU). With `fused=True` they are Megatron-LM's fused kernels (its
paper's implementation): LayerNormalizations 2 s*h each, two bias-dropout-adds 3.5 s*h
each (a one-byte dropout mask), scale-mask-softmax 2 a*s^2, the attention dropout
2.5 a*s^2, bias-GELU 2 s*f.

A transformer layer's six matmuls and the head's are given by shape (`Gemm`:
query/key/value, attention's per-head scores and context, the output projection, the
two feed-forward matmuls), for `step_time.py` to time each by its shape.

The counts stay close to what trained transformers' peaks show per layer
(docs/benchmarks.md#memory-estimates-against-measured-peaks); `tests/test_estimate.py`
compares whole peaks.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

from epl_trainer.core.plan.estimate import ModelCost, NodeCost
from epl_trainer.core.plan.ir import format_count

__all__ = ["BERT_SIZES", "HEADS", "Gemm", "bert", "params_only", "resnet50", "transformer"]


class Gemm(NamedTuple):
    """One forward matmul of a node per sample: a `rows` x `k` by `k` x `n` product,
    `count` times (attention's batched matmuls: once per head).

    `stacked`: a micro-batch's samples stack as rows of one matmul (a weight's product);
    otherwise each sample runs its own `count` products (attention's scores and context).
    `split` is what tensor parallelism divides (Megatron's layer): "n" the columns
    (column-parallel: query/key/value, the first feed-forward matmul, the vocabulary
    head), "k" the inner size (row-parallel: the attention output and second
    feed-forward matmuls), "count" the heads, "" nothing.
    """

    rows: float
    n: float
    k: float
    count: float = 1
    split: str = ""
    stacked: bool = True

    @property
    def flops(self) -> float:
        return 2 * self.rows * self.n * self.k * self.count


# layers, hidden, heads, ffn, position embeddings: model_zoo.bert_squad's presets. base
# and large are the published sizes (Devlin et al. 2019, section 3); tiny is the zoo's
# CPU model.
BERT_SIZES = {
    "tiny": (2, 64, 4, 256, 128),
    "base": (12, 768, 12, 3072, 512),
    "large": (24, 1024, 16, 4096, 512),
}
HEADS = ("lm", "span", "pool")
_FFN_KEPT = {"gelu": 4, "gelu_tanh": 5, "relu": 1}  # s*f kept per layer (module doc)
_FFN_ELEMENTWISE = {"gelu": 12, "gelu_tanh": 14, "relu": 4}  # s*f moved per layer
_F32 = 4


def _check_sizes(**sizes) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{key} must be an int >= 1. Received: {key}={value!r}")


def transformer(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq_len: int,
    ffn: int | None = None,
    *,
    max_position: int | None = None,
    type_vocab: int = 0,
    embedding_norm: bool = False,
    final_norm: bool = True,
    head: str = "lm",
    num_classes: int = 2,
    activation: str = "gelu",
    fused: bool = False,
    name: str = "transformer",
) -> ModelCost:
    """A transformer encoder: embeddings, `layers` attention + feed-forward layers, a head.

    Args:
      layers, hidden, heads, vocab, seq_len: the usual sizes; `hidden % heads == 0`.
      ffn: feed-forward size (default 4 * hidden).
      max_position: learned position embeddings (default `seq_len`; 0 for none).
      type_vocab: token-type embeddings (BERT: 2).
      embedding_norm: a LayerNormalization after the embeddings (BERT).
      final_norm: a LayerNormalization before the head (pre-LN models).
      head: "lm" (vocab logits per position), "span" (start/end logits per position,
        SQuAD) or "pool" (mean over positions, `num_classes` logits).
      activation: "gelu" (exact), "gelu_tanh" (approximate) or "relu" in the
        feed-forward block.
      fused: count the elementwise traffic of Megatron-LM's fused kernels instead of
        Keras's separate ops (module doc).
    """
    ffn = 4 * hidden if ffn is None else ffn
    max_position = seq_len if max_position is None else max_position
    _check_sizes(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len, ffn=ffn)
    if hidden % heads:
        raise ValueError(
            f"hidden must be divisible by heads. Received: hidden={hidden}, heads={heads}"
        )
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}. Received: head={head!r}")
    if activation not in _FFN_KEPT:
        raise ValueError(
            f"activation must be one of {tuple(_FFN_KEPT)}. Received: activation={activation!r}"
        )
    s, h, f, a = seq_len, hidden, ffn, heads
    sh = s * h
    embed_params = (vocab + max_position + type_vocab) * h + (2 * h if embedding_norm else 0)
    embed = NodeCost(
        "embeddings",
        embed_params,
        flops=sh * (2 if max_position or type_vocab else 1),
        activation_bytes=_F32 * sh * (3 if embedding_norm else 1),
        kind="Embedding",
        param_bytes=_F32 * embed_params,
        largest_tensor_bytes=_F32 * sh,
        float32_bytes=_F32 * 2 * sh if embedding_norm else 0,
    )
    layer_params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    layer_flops = 2 * s * (4 * h * h + 2 * h * f) + 4 * s * s * h + 5 * a * s * s + 20 * sh
    layer_kept = 10 * sh + a * s * s + _FFN_KEPT[activation] * s * f
    if fused:
        replicated_moved = 2 * 2 * sh + 2 * 3.5 * sh
        layer_moved = replicated_moved + 4.5 * a * s * s + 2 * s * f
    else:
        replicated_moved = (3 + 3 + 3 + 3 + 4) * sh
        layer_moved = replicated_moved + 8 * sh + 3 * a * s * s
        layer_moved += _FFN_ELEMENTWISE[activation] * s * f
    # The layer's matmuls (Megatron-LM 2021: [s, b, h] activations, strided batched matmuls
    # over the heads; Narayanan et al., appendix): query/key/value, scores, context,
    # output projection, the two feed-forward matmuls. Their FLOPs are `layer_flops`
    # less the elementwise 5 a s^2 + 20 s h.
    layer_gemms = (
        Gemm(s, 3 * h, h, split="n"),
        Gemm(s, s, h // a, a, split="count", stacked=False),
        Gemm(s, h // a, s, a, split="count", stacked=False),
        Gemm(s, h, h, split="k"),
        Gemm(s, f, h, split="n"),
        Gemm(s, h, f, split="k"),
    )
    blocks = [
        NodeCost(
            f"layer_{i}",
            layer_params,
            flops=layer_flops,
            activation_bytes=_F32 * layer_kept,
            kind="TransformerLayer",
            param_bytes=_F32 * layer_params,
            largest_tensor_bytes=_F32 * max(s * f, a * s * s),
            float32_bytes=_F32 * 4 * sh,  # the two LayerNormalizations' input and factor
            elementwise_bytes=round(_F32 * layer_moved),
            tp_replicated_bytes=_F32 * 6 * sh,
            tp_replicated_elementwise_bytes=round(_F32 * replicated_moved),
            gemms=layer_gemms,
        )
        for i in range(layers)
    ]
    outputs = {"lm": vocab, "span": 2, "pool": num_classes}[head]
    rows = 1 if head == "pool" else s
    head_params = h * outputs + outputs + (2 * h if final_norm else 0)
    # Kept: the final norm's input and factor, the head's input, logits and softmax.
    head_kept = (2 * sh if final_norm else 0) + sh + 2 * rows * outputs
    head_node = NodeCost(
        f"{head}_head",
        head_params,
        flops=2 * rows * h * outputs + (8 * sh if final_norm else 0),
        activation_bytes=_F32 * head_kept,
        kind="Head",
        param_bytes=_F32 * head_params,
        largest_tensor_bytes=_F32 * max(sh, rows * outputs),
        float32_bytes=_F32 * 2 * sh if final_norm else 0,
        gemms=(Gemm(rows, outputs, h, split="n"),),
    )
    nodes = (embed, *blocks, head_node)
    # Every block boundary passes the residual stream, s*h floats per sample.
    crossing = (0, *([_F32 * sh] * (len(nodes) - 1)), 0)
    return ModelCost(
        name=name,
        nodes=nodes,
        # The embeddings join the first stage and the head the last, as the automatic
        # partition does (cuts only between repeated blocks).
        cut_positions=tuple(range(2, len(nodes) - 1)),
        crossing_bytes=crossing,
        checkpoint_positions=tuple(range(1, len(nodes))),
        input_bytes=4 * s * (2 if type_vocab else 1) + 4 * (2 if head == "span" else 1),
        description=(
            f"{layers} layers, hidden {h}, {a} heads, ffn {f}, vocab {vocab}, "
            f"sequence {s}, {head} head"
        ),
    )


def bert(size: str = "base", seq_len: int | None = None, vocab: int = 30522) -> ModelCost:
    """`model_zoo.bert_squad`'s BERT: post-LN, tanh-approximated GELU, a SQuAD span head.

    `bert("base")` has 108,893,186 parameters and `bert("large")` 334,094,338, the counts
    of BERT for question answering (BERT's 110M / 340M include the unused pooler).
    `seq_len` defaults to 384 (SQuAD), or the position embeddings if fewer.
    """
    if size not in BERT_SIZES:
        raise ValueError(f"size must be one of {tuple(BERT_SIZES)}. Received: size={size!r}")
    layers, hidden, heads, ffn, max_position = BERT_SIZES[size]
    seq_len = min(384, max_position) if seq_len is None else seq_len
    if seq_len > max_position:
        raise ValueError(
            f"seq_len exceeds BERT-{size}'s {max_position} position embeddings. "
            f"Received: seq_len={seq_len}"
        )
    return transformer(
        layers,
        hidden,
        heads,
        vocab,
        seq_len,
        ffn,
        max_position=max_position,
        type_vocab=2,
        embedding_norm=True,
        final_norm=False,
        head="span",
        activation="gelu_tanh",
        name=f"bert_{size}",
    )


# ResNet-50 v1 as keras.applications.ResNet50 builds it: (filters, blocks, first stride).
_RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))


def resnet50(image_size: int = 224, num_classes: int = 1000) -> ModelCost:
    """ResNet-50 (keras.applications.ResNet50: convolutions with biases, BatchNorm with
    moving statistics), one node per bottleneck block plus the stem and the head.

    Per convolution + BatchNorm + ReLU the convolution output (kept by BatchNorm) and
    the ReLU output (kept by ReLU and the next convolution) are counted; a block's last
    convolution and its shortcut keep their outputs, the add + ReLU its output.
    """
    _check_sizes(image_size=image_size, num_classes=num_classes)
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32. Received: image_size={image_size}")

    def conv(k, cin, cout, positions):
        params = k * k * cin * cout + cout + 4 * cout  # kernel, bias, BatchNorm (4 per ch)
        return params, 2 * k * k * cin * cout * positions

    def shrink(size, stride):
        return (size + stride - 1) // stride

    size = shrink(shrink(image_size, 2), 2)  # conv1 stride 2, max-pool stride 2
    params, flops = conv(7, 3, 64, shrink(image_size, 2) ** 2)
    stem_out = shrink(image_size, 2) ** 2 * 64
    stem = NodeCost(
        "stem",
        params,
        flops,
        _F32 * ((image_size + 6) ** 2 * 3 + 2 * stem_out + stem_out + size * size * 64),
        kind="ResNetStem",
        param_bytes=_F32 * params,
        largest_tensor_bytes=_F32 * stem_out,
    )
    nodes, crossing, channels = [stem], [0, _F32 * size * size * 64], 64
    for stage, (filters, count, stride) in enumerate(_RESNET50_STAGES):
        for block in range(count):
            step = stride if block == 0 else 1
            out_size = shrink(size, step)
            positions = out_size * out_size
            parts = [
                conv(1, channels, filters, positions),
                conv(3, filters, filters, positions),
                conv(1, filters, 4 * filters, positions),
            ]
            kept = 2 * 2 * filters * positions + 4 * filters * positions * 2
            if block == 0:  # projection shortcut
                parts.append(conv(1, channels, 4 * filters, positions))
                kept += 4 * filters * positions
            params = sum(p for p, _ in parts)
            flops = sum(fl for _, fl in parts) + 4 * filters * positions  # + the add
            nodes.append(
                NodeCost(
                    f"conv{stage + 2}_block{block + 1}",
                    params,
                    flops,
                    _F32 * kept,
                    kind="Bottleneck",
                    param_bytes=_F32 * params,
                    largest_tensor_bytes=_F32 * 4 * filters * positions,
                )
            )
            size, channels = out_size, 4 * filters
            crossing.append(_F32 * positions * channels)
    params = channels * num_classes + num_classes
    nodes.append(
        NodeCost(
            "head",
            params,
            2 * channels * num_classes + size * size * channels,
            _F32 * (channels + 2 * num_classes),
            kind="Head",
            param_bytes=_F32 * params,
        )
    )
    crossing.append(0)
    return ModelCost(
        name="resnet50",
        nodes=tuple(nodes),
        cut_positions=tuple(range(2, len(nodes) - 1)),
        crossing_bytes=tuple(crossing),
        checkpoint_positions=tuple(range(1, len(nodes))),
        input_bytes=_F32 * image_size * image_size * 3 + 4,
        description=f"ResNet-50, {image_size}x{image_size} images, {num_classes} classes",
    )


def params_only(params: float, name: str | None = None) -> ModelCost:
    """A model known only by its parameter count: model states, no activations or cuts
    (how the ZeRO paper states its model sizes)."""
    if isinstance(params, bool) or not isinstance(params, numbers.Real) or not params >= 1:
        raise ValueError(f"params must be a number >= 1. Received: params={params!r}")
    count = round(params)
    return ModelCost(
        name=name or f"{format_count(count)}-parameter model",
        nodes=(NodeCost("model", count, 0, 0, kind="Parameters", param_bytes=_F32 * count),),
        cut_positions=(),
        crossing_bytes=(0, 0),
        description="known by its parameter count only (no activations, no stage cuts)",
    )
