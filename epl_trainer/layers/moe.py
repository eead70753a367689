"""Mixture-of-experts feed-forward layer with GShard (top-2) / Switch (top-1) routing.

Routing, in the order `call` applies it:

1. **Groups.** The input's tokens (all leading dims flattened, row-major) are cut into
   `num_groups` equal groups *in order*: group g is the g-th contiguous chunk. Routing,
   capacity and the auxiliary loss are computed per group, so a batch sharded into n
   contiguous pieces with `num_groups / n` groups each routes exactly as the whole batch
   does. That is what lets the split (expert-parallel) version run each device's tokens
   locally and exchange them with all-to-all.
2. **Gates.** `softmax(tokens @ gate_kernel)` in float32 (also under mixed precision:
   the cumulative sums and the balancing loss are sensitive to rounding). Top-1 (Switch
   Transformer) sends each token to its argmax expert with weight = that probability.
   Top-2 (GShard) also sends it to its second-best expert; the two probabilities are
   renormalised to sum to 1 (before capacity is applied). The second expert is always
   used (GShard's random second-expert policy is not implemented).
3. **Capacity.** Each expert takes at most
   `capacity = max(min_capacity, ceil(tokens_per_group * top_k * factor / num_experts))`
   tokens per group, with `factor = capacity_factor` when training and
   `eval_capacity_factor` otherwise (`* top_k` because each token makes top_k
   assignments, as in GShard's `2N/E`).
4. **Position in expert.** A token's slot in its expert is the number of earlier tokens
   of the group routed to that expert (exclusive cumsum). Second choices queue after
   all first choices (GShard), so top-1 assignments have priority. An assignment whose
   slot is >= capacity is **dropped**: its combine weight is 0. A token with every
   assignment dropped gets an all-zero output, so in the usual residual block
   `x + MoE(x)` it passes through unchanged.
5. **Load-balancing loss** (Switch eq. 4 / GShard): per group
   `num_experts * sum_e f_e * P_e`, where f_e is the fraction of the group's tokens whose
   *first* choice is e (before capacity) and P_e the mean router probability of e;
   averaged over groups, multiplied by `aux_loss_coef` and added with `add_loss`, so it
   is in `model.losses` and in the loss the trainer differentiates. It is 1 for a
   perfectly uniform router and grows to num_experts when everything goes to one expert.

Weights are stacked along a leading expert axis so the split engine can shard experts
by slicing that axis: `gate_kernel [d, E]`, `w_in [E, d, h]`, `b_in [E, h]`,
`w_out [E, h, d]`, `b_out [E, d]`. `call` is `route` -> `dispatch_tokens` ([E, G*C, d])
-> `expert_ffn` (a pure function of the weight slices it is given) -> `combine_outputs`,
so an expert-parallel engine can run the same steps with an all-to-all after dispatch
and another before combine, each device holding E / n experts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import tensorflow as tf


class Routing(NamedTuple):
    """The result of routing `[G, S, d]` tokens (G groups of S tokens) to E experts.

    Attributes:
      dispatch: [G, S, E, C] 0/1 float: token s of group g occupies slot c of expert e.
      combine: [G, S, E, C] weights to gather expert outputs back (dispatch x gate).
      aux_loss: scalar load-balancing loss, averaged over groups (before aux_loss_coef).
      dropped_fraction: scalar, share of the G*S*top_k assignments dropped by capacity.
      capacity: C, slots per expert per group (a Python int when S is static).
    """

    dispatch: tf.Tensor
    combine: tf.Tensor
    aux_loss: tf.Tensor
    dropped_fraction: tf.Tensor
    capacity: int | tf.Tensor


@keras.saving.register_keras_serializable(package="epl_trainer")
class MoE(keras.layers.Layer):
    """Sparse mixture of `num_experts` two-layer FFN experts (see the module docstring).

    Args:
      num_experts: E, the number of experts.
      expert_hidden: h, the hidden width of every expert's FFN.
      top_k: 1 (Switch) or 2 (GShard) experts per token.
      capacity_factor: capacity multiplier while training.
      eval_capacity_factor: capacity multiplier in evaluation and prediction.
      min_capacity: lower bound on the capacity, so tiny groups still route.
      aux_loss_coef: weight of the load-balancing loss added to the model's losses.
      num_groups: how many contiguous token groups route independently.
      activation: the experts' hidden activation (a Keras activation or its name).
      kernel_initializer: for each expert's [d, h] and [h, d] matrices (fans are those
        of one expert, not of the stacked tensor).
      gate_initializer: for the router's [d, E] kernel.
      bias_initializer: for the experts' biases.

    Input [..., d]; output the same shape. The token count must divide by num_groups.
    """

    def __init__(
        self,
        num_experts: int,
        expert_hidden: int,
        top_k: int = 1,
        capacity_factor: float = 1.25,
        eval_capacity_factor: float = 2.0,
        min_capacity: int = 4,
        aux_loss_coef: float = 1e-2,
        num_groups: int = 1,
        activation="relu",
        kernel_initializer="glorot_uniform",
        gate_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_int("num_experts", num_experts, 1)
        _check_int("expert_hidden", expert_hidden, 1)
        _check_int("min_capacity", min_capacity, 1)
        _check_int("num_groups", num_groups, 1)
        if top_k not in (1, 2) or top_k > num_experts:
            raise ValueError(
                "top_k must be 1 or 2 and at most num_experts. "
                f"Received: top_k={top_k!r}, num_experts={num_experts}"
            )
        for name, value in (
            ("capacity_factor", capacity_factor),
            ("eval_capacity_factor", eval_capacity_factor),
        ):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number. Received: {name}={value!r}")
        if not isinstance(aux_loss_coef, (int, float)) or aux_loss_coef < 0:
            raise ValueError(
                f"aux_loss_coef must be a number >= 0. Received: aux_loss_coef={aux_loss_coef!r}"
            )
        self.num_experts = num_experts
        self.expert_hidden = expert_hidden
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.min_capacity = min_capacity
        self.aux_loss_coef = float(aux_loss_coef)
        self.num_groups = num_groups
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.gate_initializer = keras.initializers.get(gate_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        d, e, h = input_shape[-1], self.num_experts, self.expert_hidden
        if d is None:
            raise ValueError(f"MoE needs a known last (model) dim. Received: shape {input_shape}")
        # autocast=False: under mixed precision the router still reads float32 weights,
        # so routing decisions do not change with the compute dtype.
        self.gate_kernel = self.add_weight(
            shape=(d, e), initializer=self.gate_initializer, name="gate_kernel", autocast=False
        )
        per_expert = _PerExpert(self.kernel_initializer)
        self.w_in = self.add_weight(shape=(e, d, h), initializer=per_expert, name="w_in")
        self.b_in = self.add_weight(shape=(e, h), initializer=self.bias_initializer, name="b_in")
        self.w_out = self.add_weight(shape=(e, h, d), initializer=per_expert, name="w_out")
        self.b_out = self.add_weight(shape=(e, d), initializer=self.bias_initializer, name="b_out")

    def capacity(self, tokens_per_group, training: bool):
        """Slots per expert per group: a Python int for an int, else an int32 tensor."""
        factor = self.capacity_factor if training else self.eval_capacity_factor
        scale = self.top_k * factor / self.num_experts
        if isinstance(tokens_per_group, int):
            return max(self.min_capacity, math.ceil(tokens_per_group * scale))
        wanted = tf.math.ceil(tf.cast(tokens_per_group, tf.float32) * scale)
        return tf.maximum(self.min_capacity, tf.cast(wanted, tf.int32))

    def route(self, tokens_grouped, training: bool = False, gate_kernel=None) -> Routing:
        """Routes `[G, S, d]` tokens; see `Routing`. Reads `gate_kernel` unless given."""
        gate_kernel = self.gate_kernel if gate_kernel is None else gate_kernel
        tokens = tf.cast(tokens_grouped, tf.float32)
        logits = tf.einsum("gsd,de->gse", tokens, tf.cast(gate_kernel, tf.float32))
        probs = tf.nn.softmax(logits, axis=-1)
        num_experts = self.num_experts
        first = tf.one_hot(tf.argmax(probs, axis=-1), num_experts)  # [G, S, E]
        gate_first = tf.reduce_sum(probs * first, axis=-1)  # [G, S]

        # Balancing loss on first choices before capacity (Switch eq. 4), mean over groups.
        fraction = tf.reduce_mean(first, axis=1)  # f_e per group [G, E]
        mean_prob = tf.reduce_mean(probs, axis=1)  # P_e per group [G, E]
        aux_loss = tf.reduce_mean(num_experts * tf.reduce_sum(fraction * mean_prob, axis=-1))

        tokens_per_group = tokens_grouped.shape[1]
        if tokens_per_group is None:
            tokens_per_group = tf.shape(tokens)[1]
        capacity = self.capacity(tokens_per_group, training)
        choices = [(first, gate_first)]
        if self.top_k == 2:
            second = tf.one_hot(tf.argmax(probs * (1.0 - first), axis=-1), num_experts)
            gate_second = tf.reduce_sum(probs * second, axis=-1)
            total = gate_first + gate_second + 1e-9  # GShard: the two weights sum to 1
            choices = [(first, gate_first / total), (second, gate_second / total)]

        dispatch = combine = None
        queued = tf.zeros_like(first[:, :1, :])  # [G, 1, E] slots taken by earlier choices
        kept_total = 0.0
        for mask, gate in choices:
            position = tf.cumsum(mask, axis=1, exclusive=True) + queued  # [G, S, E]
            kept = mask * tf.cast(position < tf.cast(capacity, tf.float32), tf.float32)
            queued = queued + tf.reduce_sum(kept, axis=1, keepdims=True)
            slot = tf.cast(tf.reduce_sum(position * mask, axis=-1), tf.int32)  # [G, S]
            # one_hot of a slot >= capacity is all zero; `kept` zeroes it explicitly anyway.
            placed = kept[..., None] * tf.one_hot(slot, capacity)[:, :, None, :]  # [G,S,E,C]
            weighted = placed * gate[:, :, None, None]
            dispatch = placed if dispatch is None else dispatch + placed
            combine = weighted if combine is None else combine + weighted
            kept_total += tf.reduce_sum(kept)
        assignments = tf.cast(tf.size(first) // num_experts * self.top_k, tf.float32)
        dropped_fraction = 1.0 - kept_total / assignments
        return Routing(dispatch, combine, aux_loss, dropped_fraction, capacity)

    def expert_ffn(self, expert_inputs, w_in, b_in, w_out, b_out):
        """`[E_local, N, d]` -> `[E_local, N, d]`: expert e's FFN on row e, from the given
        weight slices only (no variable reads), so a device can run just its experts."""
        hidden = tf.einsum("end,edh->enh", expert_inputs, w_in) + b_in[:, None, :]
        hidden = self.activation(hidden)
        return tf.einsum("enh,ehd->end", hidden, w_out) + b_out[:, None, :]

    def call(self, inputs, training=None):
        training = bool(training)
        d = inputs.shape[-1]
        groups = self.num_groups
        num_tokens = math.prod(inputs.shape[:-1]) if None not in inputs.shape[:-1] else None
        if num_tokens is not None and num_tokens % groups:
            raise ValueError(
                "The MoE layer's token count must divide into num_groups equal groups. "
                f"Received: {num_tokens} tokens (input shape {tuple(inputs.shape)}), "
                f"num_groups={groups}"
            )
        tokens = tf.reshape(inputs, [groups, -1, d])  # group g = g-th contiguous chunk
        routing = self.route(tokens, training)
        expert_inputs = self.dispatch_tokens(tokens, routing.dispatch)
        expert_outputs = self.expert_ffn(
            expert_inputs,
            *(tf.cast(w, tokens.dtype) for w in (self.w_in, self.b_in, self.w_out, self.b_out)),
        )
        outputs = self.combine_outputs(expert_outputs, routing.combine)
        self.add_loss(self.aux_loss_coef * routing.aux_loss)
        return tf.reshape(outputs, tf.shape(inputs))

    def dispatch_tokens(self, tokens_grouped, dispatch):
        """`[G, S, d]` tokens -> `[E, G*C, d]` expert inputs (row e: expert e's slots,
        group-major), the tensor an expert-parallel engine all-to-alls along E."""
        dispatch = tf.cast(dispatch, tokens_grouped.dtype)
        expert_inputs = tf.einsum("gsec,gsd->egcd", dispatch, tokens_grouped)
        return tf.reshape(expert_inputs, [self.num_experts, -1, tokens_grouped.shape[-1]])

    def combine_outputs(self, expert_outputs, combine):
        """`[E, G*C, d]` expert outputs -> `[G, S, d]`, weighted by `combine [G, S, E, C]`."""
        dynamic = tf.shape(combine)
        groups, capacity = (combine.shape[i] or dynamic[i] for i in (0, 3))  # static if known
        d = expert_outputs.shape[-1]
        expert_outputs = tf.reshape(expert_outputs, [self.num_experts, groups, capacity, d])
        combine = tf.cast(combine, expert_outputs.dtype)
        return tf.einsum("gsec,egcd->gsd", combine, expert_outputs)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "num_experts": self.num_experts,
            "expert_hidden": self.expert_hidden,
            "top_k": self.top_k,
            "capacity_factor": self.capacity_factor,
            "eval_capacity_factor": self.eval_capacity_factor,
            "min_capacity": self.min_capacity,
            "aux_loss_coef": self.aux_loss_coef,
            "num_groups": self.num_groups,
            "activation": keras.activations.serialize(self.activation),
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "gate_initializer": keras.initializers.serialize(self.gate_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }


class _PerExpert:
    """Initialises a stacked `[E, a, b]` weight as E independent `[a, b]` matrices.

    Keras computes fans of a 3-D shape as if the leading axis were a convolution window,
    which would shrink a Glorot init by ~sqrt(E). A Keras initializer with an int seed
    repeats its values on every call, so expert e gets seed + e (otherwise all experts
    would start equal). An unseeded one holds an int seed too (drawn when it was made,
    `make_default_seed`), so it is treated the same way; one given a `SeedGenerator`
    draws new values on each call.
    """

    def __init__(self, initializer):
        self.initializer = initializer

    def __call__(self, shape, dtype=None):
        seed = getattr(self.initializer, "seed", None)
        repeats = isinstance(seed, int) and not isinstance(seed, bool)
        config = self.initializer.get_config() if repeats else {}
        values = []
        for expert in range(shape[0]):
            init = self.initializer
            if repeats:
                init = type(self.initializer).from_config({**config, "seed": seed + expert})
            values.append(init(tuple(shape[1:]), dtype=dtype))
        return keras.ops.stack(values)


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}. Received: {name}={value!r}")
