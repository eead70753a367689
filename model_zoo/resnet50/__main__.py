"""ResNet-50 image classification with EPL's recipes: data parallel or large-classifier split.

Run from the repo root::

    python -m model_zoo.resnet50                                   # small ResNet, generated data
    python -m model_zoo.resnet50 --epl_config configs/resnet50_dp.json --gc --zero
    python -m model_zoo.resnet50 --epl_config configs/resnet50_split.json   # 10,000 classes
    python -m model_zoo.resnet50 --nosmall --num_classes 1000 \\
        --train_files '/data/imagenet/train-*' --validation_files '/data/imagenet/validation-*'
    epl-launch --num_workers 2 --gpu_per_worker 1 model_zoo/resnet50/__main__.py

`cluster.virtual_devices` defaults to 2 here (two simulated devices on one CPU) unless
`EPL_CLUSTER_VIRTUAL_DEVICES` (set by `epl-launch`), `--epl_config` or `--epl_set` says
otherwise. Worker 0 writes TensorBoard logs to `<output_dir>/logs` and the numbers
(validation loss/accuracy before and after training, history, plan, config) to
`<output_dir>/metrics.json`.
"""

import os
import sys
from pathlib import Path

if not __package__:
    # Run as a file (epl-launch does this), not with -m: make the checkout importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info banners

from absl import app, flags

import epl_trainer.runtime.flags as epl_flags  # defines --epl_config and --epl_set
from model_zoo.resnet50 import recipe

FLAGS = flags.FLAGS
flags.DEFINE_boolean(
    "small",
    True,
    "A narrow ResNet (ResNet-50's bottleneck blocks, widths 16-32-64, one block per stage) "
    "on 32x32 images, fast on a CPU. --nosmall: Keras's ResNet-50 on 224x224 images.",
)
flags.DEFINE_integer(
    "num_classes",
    None,
    "Classifier outputs. Default: 1000 with --train_files (ImageNet), else 10,000 with the "
    "split classifier (FastNN's recipe), 1000 for ResNet-50 and 10 for --small.",
)
flags.DEFINE_integer("image_size", None, "Square input side. Default: 32 (--small) or 224.")
flags.DEFINE_boolean(
    "split_classifier",
    None,
    "Split the classifier over all devices (features replicated over them). Default: "
    "follow the recipe, i.e. split when cluster.colocate_split_and_replicate is set, as "
    "in configs/resnet50_split.json.",
)
flags.DEFINE_boolean("gc", False, "Gradient checkpointing: gradient_checkpoint.type=auto.")
flags.DEFINE_boolean("amp", False, "Mixed precision: amp.level=O1 (float16 compute).")
flags.DEFINE_boolean("zero", False, "ZeRO: zero.level=v1 (optimizer state and gradients).")
flags.DEFINE_integer(
    "batch_size", 32, "Per-worker batch: split over this worker's replicas x micro-batches."
)
flags.DEFINE_integer("epochs", 4, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", 40, "Training steps per epoch.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the initial weights and of the generated data.")
flags.DEFINE_string(
    "train_files",
    None,
    "Glob of ImageNet-format TFRecord files (image/encoded JPEG, image/class/label); each "
    "worker reads its share. Default: generated images.",
)
flags.DEFINE_string("validation_files", None, "Glob of ImageNet-format validation TFRecords.")
flags.DEFINE_integer(
    "label_offset",
    1,
    "Subtracted from image/class/label: 1 for Google's build_imagenet_data.py files "
    "(labels 1..1000, 0 = background), 0 for 0-based labels.",
)
flags.DEFINE_string("output_dir", "/tmp/epl_resnet50", "TensorBoard logs and metrics.json.")

DEFAULT_VIRTUAL_DEVICES = 2


def options_from_flags() -> recipe.Options:
    """Options from the parsed flags; --gc/--amp/--zero are applied over the config."""
    environ = dict(os.environ)
    # The environment is the config's lowest-precedence source: files and --epl_set win.
    environ.setdefault("EPL_CLUSTER_VIRTUAL_DEVICES", str(DEFAULT_VIRTUAL_DEVICES))
    config = epl_flags.config_from_flags(environ=environ)
    config = recipe.apply_overrides(
        config,
        recipe.memory_overrides(gc=FLAGS.gc, amp=FLAGS.amp, zero=FLAGS.zero),
        explicit=epl_flags.parse_assignments(FLAGS.epl_set or []),
    )
    return recipe.Options(
        config=config,
        small=FLAGS.small,
        num_classes=FLAGS.num_classes,
        image_size=FLAGS.image_size,
        split_classifier=FLAGS.split_classifier,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
        train_files=FLAGS.train_files,
        validation_files=FLAGS.validation_files,
        label_offset=FLAGS.label_offset,
        output_dir=FLAGS.output_dir,
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    options = options_from_flags()
    print(options.config)
    metrics = recipe.train(options)
    initial, final = metrics["initial_validation"], metrics["validation"]
    if final is not None:
        print(
            f"Validation loss {initial['loss']:.4f} -> {final['loss']:.4f}, accuracy "
            f"{initial['accuracy']:.4f} -> {final['accuracy']:.4f} (chance "
            f"{metrics['chance_accuracy']:.4f}); wall time {metrics['wall_time_sec']:.1f} s"
        )


if __name__ == "__main__":
    app.run(main)
