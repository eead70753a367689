"""epl-plan --layout_map: KerasHub's families by their sizes, laid out by their own
`get_layout_map`, hold per device what `EPLTrainer.placement()` reports (issue 47, item 2).

The variable lists are ours (pure Python); they are checked against the backbones KerasHub
builds, and the bytes per device against the trainer's storage of the same tiny causal LMs.
"""

import json

import keras
import numpy as np
import pytest

import epl_trainer as epl
from epl_trainer.core.plan import kerashub_layouts
from epl_trainer.runtime import kerashub_maps, plan_cli

keras_hub = pytest.importorskip("keras_hub")

SIZES = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=64,
)


def _sizes(family, tie_embeddings=None, **changes):
    """Our description of `SIZES` (plus `changes`, by KerasHub's names)."""
    size = {**SIZES, **changes}
    return kerashub_layouts.DecoderSizes(
        layers=size["num_layers"],
        hidden=size["hidden_dim"],
        heads=size["num_query_heads"],
        kv_heads=size["num_key_value_heads"],
        intermediate=size["intermediate_dim"],
        vocab=size["vocabulary_size"],
        head_dim=4 if family == "gemma" else None,
        tie_embeddings=tie_embeddings,
    )


def _backbone(family, tie_embeddings=None, **changes):
    """KerasHub's own backbone of the same sizes (random weights, nothing downloaded)."""
    keras.utils.set_random_seed(0)
    size = {**SIZES, **changes}
    if family == "gemma":
        return keras_hub.models.GemmaBackbone(**size, head_dim=4)
    if tie_embeddings is not None:
        size["tie_word_embeddings"] = tie_embeddings
    backbone = getattr(keras_hub.models, kerashub_layouts.FAMILIES[family].backbone)
    return backbone(**size)


@pytest.mark.parametrize(
    "family, tie_embeddings",
    [("llama", None), ("llama", True), ("gemma", None), ("qwen", None), ("qwen", False)],
)
def test_our_variables_are_the_paths_and_shapes_kerashub_builds(family, tie_embeddings):
    """Llama unties its embeddings by default (a reverse_embeddings output projection),
    Qwen ties them and adds query/key/value biases, Gemma's kernels are (heads, hidden,
    head_dim) and its gates half of intermediate_dim."""
    ours = kerashub_layouts.variables(family, _sizes(family, tie_embeddings))
    built = _backbone(family, tie_embeddings)
    assert len(ours) == len(built.weights)
    assert set(ours) == {(v.path, tuple(v.shape)) for v in built.weights}


def _causal_lm(family):
    backbone = _backbone(family)
    causal_lm = getattr(keras_hub.models, type(backbone).__name__.replace("Backbone", "CausalLM"))
    return causal_lm(backbone, preprocessor=None)


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen"])
@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)])
def test_bytes_per_device_are_what_the_trainer_holds(family, mesh):
    """The trainer's storage (after building its engine as `fit` does; the same numbers
    as after a step) under KerasHub's layout map: variables and gradients equal ours on
    every device, its Adam state our 2 slots plus the optimizer's scalar counters
    (iteration and learning rate, 16 bytes at most)."""
    planned = kerashub_maps.kerashub_placement(family, _sizes(family), mesh)
    model = _causal_lm(family)
    devices = keras.distribution.list_devices()[: mesh[0] * mesh[1]]
    layout_map = type(model.backbone).get_layout_map(
        keras.distribution.DeviceMesh(mesh, ("batch", "model"), devices)
    )
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    trainer.runtime.ensure(None)
    held = trainer.placement()
    assert len(held) == mesh[0] * mesh[1]
    assert set(held.values()) == {planned.bytes_per_device}
    assert planned.model_bytes == sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    assert planned.bytes_per_device < 0.6 * planned.model_bytes
    states = planned.states_per_device(optimizer_slots=2)
    for row in trainer.memory_report(print_table=False).devices.values():
        assert row.gradients == states["gradients"]
        assert 0 <= row.optimizer - states["optimizer"] <= 16


# Llama-2-7B (KerasHub's llama2_7b_en): a device's share of the variables, by hand. Every
# sharded variable is laid out over both axes, so (1, 8) and (2, 4) hold the same.
LLAMA2_7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008",
             "--vocab", "32000"]  # fmt: skip
LLAMA2_7B_PER_DEVICE = (
    32000 * 4096 * 4 // 8  # token_embedding/embeddings: (model, batch)
    + 4096 * 32000 * 4  # reverse_embeddings: replicated (no key of the map names it)
    + 32 * (4 * 4096 * 4096 * 4 // 8 + 3 * 4096 * 11008 * 4 // 8 + 2 * 4096 * 4)
    + 4096 * 4  # the final norm
)


@pytest.mark.parametrize("mesh", ["1,8", "2,4"])
def test_cli_prints_the_placement_table_and_json(capsys, mesh):
    args = ["--layout_map", "llama", *LLAMA2_7B, "--mesh", mesh, "--device_memory", "80GB"]
    assert plan_cli.main(args) == 0
    text = capsys.readouterr().out
    assert f"DeviceMesh (batch, model) = ({mesh.replace(',', ', ')}), 8 devices" in text
    assert "token_embedding/reverse_embeddings" in text
    assert "transformer_layer_*/self_attention/query/kernel" in text
    assert f"{LLAMA2_7B_PER_DEVICE:,} bytes of variables" in text
    assert plan_cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    placed = data["layout_map"]
    assert placed["bytes_per_device"] == LLAMA2_7B_PER_DEVICE == 3_828_891_648
    assert placed["placement"] == {f"gpu:{i}": LLAMA2_7B_PER_DEVICE for i in range(8)}
    assert placed["states_per_device"] == {
        "variables": LLAMA2_7B_PER_DEVICE,
        "gradients": LLAMA2_7B_PER_DEVICE,
        "optimizer": 2 * LLAMA2_7B_PER_DEVICE,
        "total": 4 * LLAMA2_7B_PER_DEVICE,
    }
    assert placed["parameters"] == 6_738_415_616  # llama2_7b_en's count
    assert placed["mesh"] == [int(n) for n in mesh.split(",")]
    assert data["device_memory"] == 80e9


def test_cli_refuses_flags_a_layout_map_would_ignore(capsys):
    with pytest.raises(SystemExit):
        plan_cli.main(["--layout_map", "llama", *LLAMA2_7B, "--mesh", "1,8", "--zero", "v1"])
    assert "--layout_map does not take --zero" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--params", "1e9", "--mesh", "1,8"])
    assert "--mesh describe a --layout_map" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--layout_map", "gemma", *LLAMA2_7B, "--mesh", "1,8"])
    assert "--layout_map gemma needs --head_dim" in capsys.readouterr().err


def test_an_indivisible_layout_names_the_variable_as_the_trainer_does(capsys):
    """Vocabulary 63 divides over a model axis of 3; hidden 16 does not, so Llama's first
    query kernel, laid out ('model', 'batch', None), cannot be: the plan's words are the
    trainer's."""
    expected = (
        "Variable 'transformer_layer_0/self_attention/query/kernel' of shape (16, 4, 4) is "
        "laid out ('model', 'batch', None): dimension 0 (16) is not divisible by mesh axis "
        "'model' of size 3."
    )
    with pytest.raises(ValueError) as planned:
        kerashub_maps.kerashub_placement("llama", _sizes("llama", vocabulary_size=63), (1, 3))
    assert str(planned.value) == expected
    backbone = _backbone("llama", vocabulary_size=63)
    mesh = keras.distribution.DeviceMesh((1, 3), ("batch", "model"),
                                         keras.distribution.list_devices()[:3])  # fmt: skip
    strategy = keras.distribution.ModelParallel(layout_map=backbone.get_layout_map(mesh))
    with pytest.raises(ValueError) as trained:
        epl.EPLTrainer(keras_hub.models.LlamaCausalLM(backbone, preprocessor=None),
                       "mse", "sgd", strategy=strategy)  # fmt: skip
    assert expected in str(trained.value)
    with pytest.raises(SystemExit):
        plan_cli.main(["--layout_map", "llama", "--layers", "2", "--hidden", "16", "--heads",
                       "4", "--ffn", "64", "--vocab", "63", "--mesh", "1,3"])  # fmt: skip
    assert expected in capsys.readouterr().err
