"""The ResNet-50 recipes: configs run, the ImageNet TFRecord reader, flags, models, data."""

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

import epl_trainer as epl
from epl_trainer.annotations import strategies
from epl_trainer.core.plan import planner
from model_zoo.resnet50 import __main__ as resnet_main
from model_zoo.resnet50 import data as data_lib
from model_zoo.resnet50 import model as model_lib
from model_zoo.resnet50 import recipe

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(CONFIGS.glob("resnet50_*.json"))


def _options(config, **overrides):
    """A few steps of the small ResNet: what every run-test trains."""
    values = dict(config=config, small=True, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    values.update(overrides)
    return recipe.Options(**values)


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"resnet50_dp.json", "resnet50_split.json"}


@pytest.mark.slow  # a few steps, but compiling a ResNet train step takes 10-60 s on 2 cores
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_runs_two_steps(path, tmp_path):
    config = epl.Config.from_file(path)
    metrics = recipe.train(_options(config, num_classes=None, output_dir=str(tmp_path)))

    assert metrics["history"]["loss"] and np.isfinite(metrics["history"]["loss"]).all()
    # Two steps lower the validation loss (seeded; 2.30642 -> 2.30636 and 9.21021 ->
    # 9.20962 when measured): a trainer that applied nothing would leave it unchanged.
    assert metrics["validation"]["loss"] < metrics["initial_validation"]["loss"]
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["config"] == config.to_dict()
    assert written["plan"]["devices_per_replica"] * written["plan"]["num_replicas"] == 2
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))  # TensorBoard
    kinds = [tg["kind"] for tg in written["plan"]["taskgraphs"]]
    split = path.name == "resnet50_split.json"
    assert kinds == (["replicate", "split"] if split else ["replicate"])
    assert written["num_classes"] == (recipe.SPLIT_CLASSES if split else recipe.SMALL_CLASSES)


def test_split_recipe_plans_features_replicated_and_classifier_split():
    """EPL's large-classifier layout, as the planner places it."""
    config = epl.Config.from_file(CONFIGS / "resnet50_split.json")
    options = _options(config)
    assert recipe.wants_split(options)
    assert recipe.default_num_classes(options) == recipe.SPLIT_CLASSES
    model = model_lib.build_model(recipe.default_num_classes(options), small=True)
    strategy = recipe.parallel_strategy(True, total_devices=2)

    annotation = strategies.resolve_annotation(model, strategy)
    plan = planner.build_plan(
        annotation.taskgraphs,
        [["/cpu:0", "/cpu:1"]],
        0,
        num_micro_batch=1,
        colocate_split_and_replicate=config.cluster.colocate_split_and_replicate,
    )

    features, head = plan.taskgraphs
    assert (features.kind, features.device_count) == ("replicate", 2)
    assert (head.kind, head.device_count) == ("split", 2)
    # Colocated: both TaskGraphs on the same 2 devices, one replica of 2 devices.
    assert (plan.num_replicas, plan.devices_per_replica) == (1, 2)
    assert plan.placement[0][0] == plan.placement[0][1]
    in_split = {n.operation.name for n, tg in annotation.node_taskgraph.items() if tg == 1}
    assert in_split == {model_lib.CLASSIFIER}


def test_split_classifier_without_colocation_needs_twice_the_devices():
    options = _options(epl.Config({"cluster.virtual_devices": 2}), split_classifier=True)
    with pytest.raises(ValueError, match="colocate_split_and_replicate=True"):
        recipe.build_trainer(options, epl.init(options.config).cluster)


# ----------------------------------------------------------------------------- flags
def test_memory_flags_map_to_fastnn_config_keys():
    assert recipe.memory_overrides() == {}
    assert recipe.memory_overrides(gc=True, amp=True, zero=True) == {
        "gradient_checkpoint.type": "auto",
        "amp.level": "O1",
        "zero.level": "v1",
    }


def _parsed_options(argv):
    with flagsaver.flagsaver():
        flags.FLAGS(["resnet50", *argv])
        try:
            return resnet_main.options_from_flags()
        finally:
            flags.FLAGS.unparse_flags()


def test_command_line_flags_reach_the_config():
    options = _parsed_options(
        [
            f"--epl_config={CONFIGS / 'resnet50_dp.json'}",
            "--gc",
            "--amp",
            "--zero",
            "--epl_set=pipeline.num_micro_batch=2",
            "--num_classes=7",
            "--nosmall",
        ]
    )
    config = options.config
    assert config.gradient_checkpoint.type == "auto"
    assert config.amp.level == "O1"
    assert config.zero.level == "v1"
    assert config.pipeline.num_micro_batch == 2
    assert config.cluster.virtual_devices == 2  # from the recipe file
    assert (options.num_classes, options.small) == (7, False)


def test_defaults_are_the_small_data_parallel_run():
    options = _parsed_options([])
    assert options.small and not recipe.wants_split(options)
    assert recipe.default_num_classes(options) == recipe.SMALL_CLASSES
    assert options.config.gradient_checkpoint.type == ""
    assert options.config.zero.level == ""


def test_imagenet_files_default_to_1000_classes():
    options = _parsed_options(["--train_files=/data/train-*"])
    assert recipe.default_num_classes(options) == recipe.IMAGENET_CLASSES
    split = _parsed_options(["--split_classifier"])
    assert recipe.default_num_classes(split) == recipe.SPLIT_CLASSES


def test_shortcut_flag_contradicting_epl_set_is_an_error():
    with pytest.raises(ValueError, match=r"zero\.level: flag gives 'v1', --epl_set gives 'v0'"):
        _parsed_options(["--zero", "--epl_set=zero.level=v0"])
    same = _parsed_options(["--zero", "--epl_set=zero.level=v1"])
    assert same.config.zero.level == "v1"
    # --zero is zero.level v1, DeepSpeed's zero.stage 2: the other spelling clashes too.
    with pytest.raises(ValueError, match=r"zero\.level: flag gives 'v1', --epl_set gives 'v0'"):
        _parsed_options(["--zero", "--epl_set=zero.stage=1"])
    assert _parsed_options(["--zero", "--epl_set=zero.stage=2"]).config.zero.stage == 2


# ------------------------------------------------------------------------------ models
def test_resnet50_is_keras_resnet50_with_our_classifier():
    ours = model_lib.build_model(1000, small=False)
    reference = keras.applications.ResNet50(weights=None, classes=1000)
    assert ours.count_params() == reference.count_params()  # 25,636,712
    assert ours.input_shape == (None, 224, 224, 3)
    assert ours.get_layer(model_lib.CLASSIFIER).input.shape == (None, 2048)


def test_small_resnet_uses_bottleneck_blocks_on_32x32():
    small = model_lib.build_model(10, small=True)
    assert small.input_shape == (None, 32, 32, 3)
    assert small.output_shape == (None, 10)
    names = {layer.name for layer in small.layers}
    assert {"conv2_block1_3_conv", "conv4_block1_0_conv", "conv4_block1_add"} <= names
    assert small.get_layer(model_lib.CLASSIFIER).input.shape == (None, 4 * 64)
    assert small.count_params() < 200_000


def test_build_model_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_classes=1"):
        model_lib.build_model(1, small=True)
    with pytest.raises(ValueError, match="image_size=16"):
        model_lib.build_model(10, small=False, image_size=16)


# ------------------------------------------------------------------------ generated data
def test_generated_data_is_reproducible_and_labelled_in_range():
    def first(seed):
        dataset = data_lib.generated_dataset(10, 32, 6, seed=seed, num_batches=2)
        return [(x.numpy(), y.numpy()) for x, y in dataset]

    a, b, c = first(0), first(0), first(1)
    assert len(a) == 2
    images, labels = a[0]
    assert images.shape == (6, 32, 32, 3) and images.dtype == np.float32
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < 10
    np.testing.assert_array_equal(a[0][0], b[0][0])
    assert not np.allclose(a[0][0], c[0][0])


def test_generated_classes_differ_by_their_pattern():
    """Noise-free class means are far apart relative to the noise: the task is learnable."""
    gratings, codes = data_lib.class_patterns(10, 32)
    means = data_lib.SIGNAL_STD * np.einsum("cp,phwk->chwk", codes, gratings)
    distances = [np.linalg.norm(means[i] - means[j]) for i in range(10) for j in range(i + 1, 10)]
    noise_norm_along_a_direction = data_lib.NOISE_STD  # projection of white noise
    assert min(distances) > 5 * noise_norm_along_a_direction


# ------------------------------------------------------------------ ImageNet TFRecords
def _write_imagenet_records(path, labels, seed):
    """ImageNet-format records (build_imagenet_data.py keys) with JPEGs of varied sizes."""
    rng = np.random.default_rng(seed)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i, label in enumerate(labels):
            height, width = 40 + 8 * i, 56 - 4 * i
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            jpeg = tf.io.encode_jpeg(pixels).numpy()
            feature = {
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"JPEG"])),
                "image/height": tf.train.Feature(int64_list=tf.train.Int64List(value=[height])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


@pytest.fixture
def imagenet_files(tmp_path):
    """Two shards with 1-based labels 1..3, as Google's ImageNet TFRecords have."""
    _write_imagenet_records(tmp_path / "train-00000-of-00002", [1, 2, 3], seed=0)
    _write_imagenet_records(tmp_path / "train-00001-of-00002", [3, 1, 2], seed=1)
    return tmp_path


def test_worker_files_are_the_sorted_glob_on_one_worker(imagenet_files):
    options = _options(epl.Config({"cluster.virtual_devices": 2}))
    trainer = recipe.build_trainer(options, epl.init(options.config).cluster)
    files = recipe.worker_files(str(imagenet_files / "train-*"), trainer)
    assert [Path(f).name for f in files] == ["train-00000-of-00002", "train-00001-of-00002"]


def test_imagenet_reader_shifts_one_based_labels(imagenet_files):
    files = sorted(str(f) for f in imagenet_files.glob("train-*"))
    dataset = data_lib.imagenet_dataset(
        files, image_size=24, num_classes=3, batch_size=4, training=False
    )
    batches = list(dataset)
    labels = np.concatenate([y.numpy() for _, y in batches])
    # Records of the two files interleave in order (f0 r0, f1 r0, f0 r1, ...); 1..3 -> 0..2.
    np.testing.assert_array_equal(labels, [0, 2, 1, 0, 2, 1])
    assert [tuple(x.shape) for x, _ in batches] == [(4, 24, 24, 3), (2, 24, 24, 3)]
    assert batches[0][0].dtype == tf.float32


def test_imagenet_reader_with_zero_based_labels_and_training_augmentation(imagenet_files):
    dataset = data_lib.imagenet_dataset(
        sorted(str(f) for f in imagenet_files.glob("train-*")),
        image_size=16,
        num_classes=4,
        batch_size=4,
        training=True,
        label_offset=0,
    )
    images, labels = next(iter(dataset))
    assert images.shape == (4, 16, 16, 3)  # full batches only, cropped and resized
    assert set(labels.numpy()) <= {1, 2, 3}


def test_imagenet_label_out_of_range_is_an_error(imagenet_files):
    dataset = data_lib.imagenet_dataset(
        [str(imagenet_files / "train-00000-of-00002")],
        image_size=16,
        num_classes=2,  # label 3 - 1 = 2 does not fit
        batch_size=3,
        training=False,
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_classes=2"):
        list(dataset)


@pytest.mark.slow  # compiles a ResNet train step, like the recipe runs
def test_recipe_trains_on_imagenet_tfrecords_with_gc_and_zero(imagenet_files):
    """The real-data path end to end; also the memory flags on a ResNet (one run: each
    run compiles a ResNet train step, the slow part of these tests)."""
    config = recipe.apply_overrides(
        epl.Config({"cluster.virtual_devices": 2}),
        recipe.memory_overrides(gc=True, zero=True),
        explicit={},
    )
    options = _options(
        config,
        num_classes=3,
        image_size=24,
        batch_size=4,
        train_files=str(imagenet_files / "train-*"),
        validation_files=str(imagenet_files / "train-00000-*"),
    )
    metrics = recipe.train(options)
    assert metrics["data"] == options.train_files
    assert metrics["image_size"] == 24
    assert metrics["config"]["gradient_checkpoint.type"] == "auto"
    assert metrics["config"]["zero.level"] == "v1"
    assert np.isfinite(metrics["validation"]["loss"])
