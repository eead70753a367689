"""Input pipelines: generated images with learnable structure, and ImageNet TFRecords.

Generated data: each class has a fixed random code over `NUM_PATTERNS` coloured
sinusoidal gratings; an image is its class's mix of the gratings plus Gaussian noise,
at a random offset (so the network has to learn the patterns, not pixel positions).
Classes are therefore separable but not trivially, and the loss falls visibly within
a few hundred steps. Every batch is a pure function of (seed, batch index) through
TensorFlow's stateless random ops: reproducible, and cheap to make on the fly.

ImageNet TFRecords: the format of Google's `build_imagenet_data.py` (TF-slim, the TPU
and Keras model gardens): `image/encoded` holds JPEG bytes and `image/class/label` an
int64 in 1..1000, label 0 being reserved for a "background" class. `label_offset`
(default 1) is subtracted, so the classifier's outputs are 0..999; records whose label
falls outside [0, num_classes) after that stop the input with an error naming it.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

NUM_PATTERNS = 16  # gratings the class codes mix
NOISE_STD = 1.0
SIGNAL_STD = 0.3  # per-pixel std of the class signal, before noise
PATTERN_SEED = 1234  # same gratings and class codes for every split, seed and worker
MAX_SHIFT_FRACTION = 0.125  # random translation, as a fraction of the image side
IMAGENET_LABEL_OFFSET = 1  # build_imagenet_data.py writes labels 1..1000
EVAL_CROP_FRACTION = 0.875  # standard ImageNet evaluation: central 87.5% crop
SHUFFLE_BUFFER = 10_000  # training records shuffled at a time


# ------------------------------------------------------------------ generated images
def class_patterns(num_classes: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(gratings [P, H, W, 3], class codes [C, P]) shared by every split of the data."""
    rng = np.random.default_rng(PATTERN_SEED)
    coords = np.arange(image_size, dtype=np.float32) / image_size
    ys, xs = np.meshgrid(coords, coords, indexing="ij")
    gratings = []
    for _ in range(NUM_PATTERNS):
        fy, fx = rng.integers(-3, 4, size=2)
        phase = rng.uniform(0, 2 * np.pi)
        colour = rng.normal(size=3)
        wave = np.cos(2 * np.pi * (fy * ys + fx * xs) + phase)
        gratings.append(wave[..., None] * colour)
    gratings = np.stack(gratings).astype(np.float32)
    gratings /= gratings.std()
    codes = rng.normal(size=(num_classes, NUM_PATTERNS)) / math.sqrt(NUM_PATTERNS)
    return gratings, codes.astype(np.float32)


def generated_dataset(
    num_classes: int, image_size: int, batch_size: int, *, seed: int, num_batches: int | None
) -> tf.data.Dataset:
    """Batches of (images [B, S, S, 3] float32, labels [B] int32) made on the fly.

    Args:
      num_batches: batches to yield, or None for an endless stream (training with
        `steps_per_epoch`).
      seed: batch i is a function of (seed, i): different seeds give disjoint-looking
        training and validation sets from the same classes.
    """
    gratings, codes = class_patterns(num_classes, image_size)
    gratings = tf.constant(gratings)
    codes = tf.constant(codes)
    max_shift = int(image_size * MAX_SHIFT_FRACTION)

    def make_batch(index):
        key = tf.stack([tf.cast(seed, tf.int64), index])
        labels = tf.random.stateless_uniform(
            [batch_size], seed=key, minval=0, maxval=num_classes, dtype=tf.int32
        )
        signal = tf.einsum("bp,phwc->bhwc", tf.gather(codes, labels), gratings)
        # One random translation per batch keeps this cheap; it still varies every step.
        shifts = tf.random.stateless_uniform(
            [2], seed=key + 1, minval=-max_shift, maxval=max_shift + 1, dtype=tf.int32
        )
        signal = tf.roll(signal, shift=shifts, axis=[1, 2])
        noise = tf.random.stateless_normal(tf.shape(signal), seed=key + 2)
        return SIGNAL_STD * signal + NOISE_STD * noise, labels

    indices = (
        tf.data.Dataset.counter() if num_batches is None else tf.data.Dataset.range(num_batches)
    )
    return indices.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


# ----------------------------------------------------------------- ImageNet TFRecords
_FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def parse_imagenet_record(
    record,
    *,
    image_size: int,
    num_classes: int,
    training: bool,
    label_offset: int = IMAGENET_LABEL_OFFSET,
):
    """One serialized ImageNet `tf.train.Example` -> (image [S, S, 3] float32, label int32).

    Training images get the standard Inception-style augmentation (a random crop covering
    8%-100% of the image with aspect ratio 3/4-4/3, resized, random horizontal flip);
    evaluation images a central 87.5% crop. Pixels are then normalised as Keras's
    ResNet-50 expects (`keras.applications.resnet50.preprocess_input`: BGR, ImageNet
    mean subtracted), so weights trained here follow Keras's convention.
    """
    parsed = tf.io.parse_single_example(record, _FEATURES)
    label = parsed["image/class/label"] - label_offset
    checks = [
        tf.debugging.assert_greater_equal(
            label,
            tf.constant(0, tf.int64),
            message=f"An image label minus label_offset={label_offset} is negative",
        ),
        tf.debugging.assert_less(
            label,
            tf.constant(num_classes, tf.int64),
            message=f"An image label minus label_offset={label_offset} is >= "
            f"num_classes={num_classes}",
        ),
    ]
    with tf.control_dependencies(checks):
        label = tf.cast(label, tf.int32)
    encoded = parsed["image/encoded"]
    if training:
        image = _decode_random_crop(encoded)
        image = tf.image.random_flip_left_right(image)
    else:
        image = tf.image.central_crop(tf.io.decode_jpeg(encoded, channels=3), EVAL_CROP_FRACTION)
    image = tf.image.resize(image, [image_size, image_size], antialias=True)
    image = keras.applications.resnet50.preprocess_input(image)
    return image, label


def _decode_random_crop(encoded):
    """Inception-style random crop (the standard ImageNet training augmentation).

    The crop window is chosen from the JPEG header and only that window is decoded
    (`decode_and_crop_jpeg`), which saves most of the decoding work for small crops.
    """
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.io.extract_jpeg_shape(encoded),
        bounding_boxes=tf.zeros([1, 0, 4]),
        min_object_covered=0.1,
        aspect_ratio_range=(0.75, 1.33),
        area_range=(0.08, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    return tf.image.decode_and_crop_jpeg(encoded, window, channels=3)


def imagenet_dataset(
    files: list[str],
    *,
    image_size: int,
    num_classes: int,
    batch_size: int,
    training: bool,
    label_offset: int = IMAGENET_LABEL_OFFSET,
    seed: int = 0,
) -> tf.data.Dataset:
    """Batches of (images, labels) from this worker's ImageNet TFRecord files.

    Training data is shuffled (file order and a 10k-record buffer), repeated without end
    (train with `steps_per_epoch`: every worker must run the same number of steps) and
    batched with `drop_remainder` (the batch must divide over the replicas). Evaluation
    data is one pass, in order, with a last partial batch.
    """
    if not files:
        raise ValueError("imagenet_dataset needs at least one file. Received: files=[]")
    dataset = tf.data.Dataset.from_tensor_slices(list(files))
    if training:
        dataset = dataset.shuffle(len(files), seed=seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(files), 8),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training,
    )
    if training:
        # Shuffles serialized records (~110 kB each for ImageNet): about 1 GB of buffer,
        # the size TensorFlow's official ResNet input pipeline uses.
        dataset = dataset.shuffle(SHUFFLE_BUFFER, seed=seed)

    def parse(record):
        return parse_imagenet_record(
            record,
            image_size=image_size,
            num_classes=num_classes,
            training=training,
            label_offset=label_offset,
        )

    dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.batch(batch_size, drop_remainder=training)
    return dataset.prefetch(tf.data.AUTOTUNE)
