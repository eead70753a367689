"""The ResNet-50 recipes: config shortcuts, the parallel layout, and the training run.

`__main__.py` only turns absl flags into `Options` and calls `train`; tests call `train`
directly with a few steps.

Two layouts (EPL's documented ResNet recipes):

* data parallel (`configs/resnet50_dp.json`): the whole model is one `replicate(1)`
  TaskGraph, one replica per device;
* large-classifier split (`configs/resnet50_split.json`, EPL's "large-scale image
  classification"): the convolutional features are `replicate(N)` (each replica's batch
  split over all N devices of the job) and the classifier is `split(N)` (its weight
  sharded over the same devices), with `cluster.colocate_split_and_replicate=True` so
  the two TaskGraphs share the devices instead of needing 2N.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import keras

import epl_trainer as epl
from epl_trainer.config import sections as config_lib
from epl_trainer.core.engine.state import lanes_for_worker
from epl_trainer.training.io import slice_files
from model_zoo.resnet50 import data as data_lib
from model_zoo.resnet50 import model as model_lib

# FastNN's ResNet recipe: --gc, --amp, --zero switch these keys on (its amp.level "o1"
# is spelled "O1" in our config; the loss scale stays dynamic, DeepSpeed's default,
# where FastNN fixed 10000 -- set amp.loss_scale with --epl_set to reproduce that).
MEMORY_FLAGS = {
    "gc": ("gradient_checkpoint.type", "auto"),
    "amp": ("amp.level", "O1"),
    "zero": ("zero.level", "v1"),
}
SPLIT_CLASSES = 10_000  # FastNN's resnet_split.py class_num
IMAGENET_CLASSES = 1000
SMALL_CLASSES = 10
NUM_VALIDATION_BATCHES = 8  # generated validation set, per worker


@dataclasses.dataclass(frozen=True)
class Options:
    """One training run; the absl flags of `__main__.py` map onto these fields."""

    config: epl.Config
    small: bool = True
    num_classes: int | None = None  # None: by recipe (see default_num_classes)
    image_size: int | None = None  # None: 32 (small) or 224
    split_classifier: bool | None = None  # None: follow cluster.colocate_split_and_replicate
    batch_size: int = 32
    epochs: int = 4
    steps_per_epoch: int = 40
    learning_rate: float = 1e-3
    seed: int = 0
    train_files: str | None = None  # ImageNet TFRecord glob; None: generated images
    validation_files: str | None = None
    label_offset: int = data_lib.IMAGENET_LABEL_OFFSET
    output_dir: str | None = None  # TensorBoard logs and metrics.json (chief only)
    verbose: int = 2


def memory_overrides(gc: bool = False, amp: bool = False, zero: bool = False) -> dict:
    """The config keys that `--gc`, `--amp` and `--zero` turn on (FastNN's mapping)."""
    chosen = {"gc": gc, "amp": amp, "zero": zero}
    return dict(value for name, value in MEMORY_FLAGS.items() if chosen[name])


def apply_overrides(config: epl.Config, overrides: dict, explicit: dict) -> epl.Config:
    """`config` with the shortcut flags' `overrides`, refusing ones that contradict
    `explicit` (the `--epl_set` assignments, which otherwise win over everything).

    Raises:
      ValueError: a shortcut flag and `--epl_set` give the same key different values.
    """
    # Compared as settings: --epl_set zero.stage=1 is zero.level 'v0' (config.spellings).
    given = epl.Config(explicit, environ={}).to_dict()
    named = {key for k in explicit for key in config_lib.spellings(k)}
    clashes = {k: (v, given[k]) for k, v in overrides.items() if k in named and v != given[k]}
    if clashes:
        terms = ", ".join(
            f"{k}: flag gives {a!r}, --epl_set gives {b!r}" for k, (a, b) in clashes.items()
        )
        raise ValueError(f"A shortcut flag contradicts --epl_set. Received: {terms}")
    return config.replace(overrides) if overrides else config


def wants_split(options: Options) -> bool:
    """Whether the classifier is split: the flag, else the recipe's colocation key
    (colocation only matters for the split layout, so the split recipe sets it)."""
    if options.split_classifier is not None:
        return options.split_classifier
    return options.config.cluster.colocate_split_and_replicate


def default_num_classes(options: Options) -> int:
    """--num_classes when given; else 1000 with ImageNet files, 10,000 for the split
    recipe on generated data (FastNN's), 1000 for ResNet-50 and 10 for the small variant."""
    if options.num_classes is not None:
        return options.num_classes
    if options.train_files:
        return IMAGENET_CLASSES
    if wants_split(options):
        return SPLIT_CLASSES
    return SMALL_CLASSES if options.small else IMAGENET_CLASSES


def parallel_strategy(split_classifier: bool, total_devices: int) -> epl.Strategy | None:
    """EPL's layout as data: None (plain data parallelism), or features `replicate(N)` +
    classifier `split(N)` over the job's N devices (EPL's large-classifier recipe)."""
    if not split_classifier:
        return None
    return epl.Strategy(
        default=epl.replicate(total_devices, name="features"), split=[model_lib.CLASSIFIER]
    )


def build_trainer(options: Options, cluster) -> epl.EPLTrainer:
    """The model, loss, optimizer and layout of the recipe."""
    num_classes = default_num_classes(options)
    model = model_lib.build_model(
        num_classes, small=options.small, image_size=options.image_size, seed=options.seed
    )
    split = wants_split(options)
    metrics = ["accuracy"]
    # A split classifier's logits stay sharded; the engine computes accuracy from a
    # distributed argmax, but has no distributed top-k.
    if num_classes > 5 and not split:
        metrics.append(keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5_accuracy"))
    return epl.EPLTrainer(
        model,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(options.learning_rate),
        metrics=metrics,
        strategy=parallel_strategy(split, cluster.total_gpu_num),
        config=options.config,
    )


def worker_files(pattern: str, trainer: epl.EPLTrainer) -> list[str]:
    """This worker's share of the files matching `pattern` (`epl.io.slice_files`).

    Shares are proportional to each worker's replicas in the trainer's plan, and
    `io.unbalanced_io_slicing` / `io.drop_last_files` decide what happens to files that
    do not divide evenly. The recipe always slices: `io.slicing` itself only concerns
    `EPLTrainer.fit(files, parse_fn=...)`, and this pipeline shuffles and augments, which
    that reader does not.
    """
    workers = range(trainer.cluster.worker_num)
    return slice_files(
        pattern,
        worker_index=trainer.cluster.worker_index,
        replicas_per_worker=[len(lanes_for_worker(trainer.plan, w)) for w in workers],
        unbalanced_io_slicing=trainer.config.io.unbalanced_io_slicing,
        drop_last_files=trainer.config.io.drop_last_files,
    )


def datasets(options: Options, trainer: epl.EPLTrainer, num_classes: int, image_size: int):
    """(training, validation) datasets of this worker's batches."""
    cluster = trainer.cluster
    if options.train_files:
        common = dict(
            image_size=image_size,
            num_classes=num_classes,
            batch_size=options.batch_size,
            label_offset=options.label_offset,
            seed=options.seed + cluster.worker_index,
        )
        train = data_lib.imagenet_dataset(
            worker_files(options.train_files, trainer), training=True, **common
        )
        validation = None
        if options.validation_files:
            validation = data_lib.imagenet_dataset(
                worker_files(options.validation_files, trainer), training=False, **common
            )
        return train, validation
    # Generated: distinct streams per worker and for validation, the same classes.
    seed = 1000 * options.seed + 2 * cluster.worker_index
    common = dict(num_classes=num_classes, image_size=image_size, batch_size=options.batch_size)
    train = data_lib.generated_dataset(**common, seed=seed, num_batches=None)
    validation = data_lib.generated_dataset(
        **common, seed=seed + 1, num_batches=NUM_VALIDATION_BATCHES
    )
    return train, validation


def train(options: Options) -> dict:
    """Trains the recipe; returns the metrics also written to `<output_dir>/metrics.json`."""
    start = time.perf_counter()
    cluster = epl.init(options.config).cluster  # devices first, before any TF work
    trainer = build_trainer(options, cluster)
    num_classes = trainer.model.output_shape[-1]
    image_size = trainer.model.input_shape[1]
    if options.verbose:
        print(trainer.plan.summary())
    train_data, validation_data = datasets(options, trainer, num_classes, image_size)
    initial = (
        trainer.evaluate(validation_data, return_dict=True) if validation_data is not None else None
    )
    callbacks = []
    if options.output_dir and cluster.is_chief:
        callbacks.append(keras.callbacks.TensorBoard(str(Path(options.output_dir) / "logs")))
    history = trainer.fit(
        train_data,
        epochs=options.epochs,
        steps_per_epoch=options.steps_per_epoch,
        validation_data=validation_data,
        callbacks=callbacks,
        verbose=options.verbose,
    )
    final = (
        trainer.evaluate(validation_data, return_dict=True) if validation_data is not None else None
    )
    metrics = {
        "model": trainer.model.name,
        "num_classes": num_classes,
        "image_size": image_size,
        "split_classifier": wants_split(options),
        "initial_validation": initial,
        "validation": final,
        "chance_accuracy": 1 / num_classes,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "epochs": len(history.epoch),
        "steps_per_epoch": options.steps_per_epoch,
        "batch_size_per_worker": options.batch_size,
        "global_batch": options.batch_size * cluster.worker_num,
        "num_workers": cluster.worker_num,
        "devices_per_worker": len(cluster.local_devices),
        "data": options.train_files or "generated",
        "wall_time_sec": time.perf_counter() - start,
        "plan": trainer.plan.to_dict(),
        "config": options.config.to_dict(),
    }
    if options.output_dir and cluster.is_chief:
        path = Path(options.output_dir) / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2) + "\n")
        if options.verbose:
            print(f"Wrote {path} and TensorBoard logs in {path.parent / 'logs'}")
    return metrics
