"""ResNet-50 (Keras's own architecture) and a narrow ResNet for CPUs, each with a
separate classifier layer that the split recipe can shard across devices.

Both models are one flat functional graph (the backbone's layers are not hidden inside
a nested model), so stage cuts, automatic gradient checkpointing (which looks for
repeated blocks) and the split pattern all see every layer.
"""

from __future__ import annotations

import keras

CLASSIFIER = "classifier"  # name of the head's Dense layer: the split recipe's pattern
FEATURES = "avg_pool"  # global average pooling: the features the classifier reads
IMAGE_SIZE = 224  # ResNet-50's ImageNet input
SMALL_IMAGE_SIZE = 32  # the small variant's CIFAR-sized input
# The small variant: stage widths (bottleneck width; outputs are 4x) and blocks per stage.
# ResNet-50 is widths (64, 128, 256, 512) with (3, 4, 6, 3) blocks.
SMALL_WIDTHS = (16, 32, 64)
SMALL_BLOCKS = (1, 1, 1)
# The small variant's BatchNormalization momentum: PyTorch's 0.1 update (Keras's 0.99 makes
# the moving statistics lag behind fast-changing weights in a run of a few hundred steps,
# and validation, which uses them, then trails training accuracy far behind).
BN_MOMENTUM = 0.9


def build_model(
    num_classes: int, *, small: bool, image_size: int | None = None, seed: int = 0
) -> keras.Model:
    """ResNet-50 features (or the small variant's) + a Dense classifier named `classifier`.

    Args:
      num_classes: classifier outputs (logits, no softmax: the loss takes logits).
      small: the narrow CPU-sized ResNet instead of ResNet-50.
      image_size: square input side; default 224 (ResNet-50) or 32 (small).
      seed: seeds the initial weights.

    Raises:
      ValueError: `num_classes` < 2, or an image too small for the network's strides.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2. Received: num_classes={num_classes}")
    image_size = image_size or (SMALL_IMAGE_SIZE if small else IMAGE_SIZE)
    # ResNet-50 halves the image 5 times (keras refuses < 32); the small variant 2 times.
    minimum = 8 if small else 32
    if image_size < minimum:
        raise ValueError(
            f"image_size must be >= {minimum} for {'the small ResNet' if small else 'ResNet-50'}."
            f" Received: image_size={image_size}"
        )
    keras.utils.set_random_seed(seed)
    images = keras.Input((image_size, image_size, 3), name="images")
    if small:
        features = small_resnet_features(images)
    else:
        backbone = keras.applications.ResNet50(
            weights=None, include_top=False, input_tensor=images, pooling="avg"
        )
        features = backbone.output
    logits = keras.layers.Dense(num_classes, name=CLASSIFIER)(features)
    name = "small_resnet" if small else "resnet50"
    return keras.Model(images, logits, name=name)


def small_resnet_features(images, widths=SMALL_WIDTHS, blocks=SMALL_BLOCKS):
    """A narrow ResNet built from ResNet-50's bottleneck block, for 32x32 inputs.

    The stem is a single 3x3 convolution without max pooling (CIFAR-style: a 7x7/2
    convolution and a pool would shrink a 32x32 image to 8x8 before the first block).
    Each later stage starts with a stride-2 block, as in ResNet-50. Layer names follow
    Keras's ResNet-50 (`conv2_block1_1_conv`, ...).
    """
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False, name="conv1_conv")(images)
    x = keras.layers.BatchNormalization(epsilon=1.001e-5, momentum=BN_MOMENTUM, name="conv1_bn")(x)
    x = keras.layers.Activation("relu", name="conv1_relu")(x)
    for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
        for block in range(count):
            stride = 2 if stage > 0 and block == 0 else 1
            x = bottleneck_block(
                x, width, stride, shortcut_conv=block == 0, name=f"conv{stage + 2}_block{block + 1}"
            )
    return keras.layers.GlobalAveragePooling2D(name=FEATURES)(x)


def bottleneck_block(x, width: int, stride: int, *, shortcut_conv: bool, name: str):
    """ResNet v1 bottleneck (Keras's `residual_block_v1`): 1x1 -> 3x3 -> 1x1 (4x width).

    The stride sits on the first 1x1 convolution, as in Keras's ResNet-50; the shortcut
    is a strided 1x1 projection when the shape changes, otherwise the identity.
    """
    if shortcut_conv:
        shortcut = keras.layers.Conv2D(4 * width, 1, strides=stride, name=f"{name}_0_conv")(x)
        shortcut = keras.layers.BatchNormalization(
            epsilon=1.001e-5, momentum=BN_MOMENTUM, name=f"{name}_0_bn"
        )(shortcut)
    else:
        shortcut = x
    x = keras.layers.Conv2D(width, 1, strides=stride, name=f"{name}_1_conv")(x)
    x = keras.layers.BatchNormalization(
        epsilon=1.001e-5, momentum=BN_MOMENTUM, name=f"{name}_1_bn"
    )(x)
    x = keras.layers.Activation("relu", name=f"{name}_1_relu")(x)
    x = keras.layers.Conv2D(width, 3, padding="same", name=f"{name}_2_conv")(x)
    x = keras.layers.BatchNormalization(
        epsilon=1.001e-5, momentum=BN_MOMENTUM, name=f"{name}_2_bn"
    )(x)
    x = keras.layers.Activation("relu", name=f"{name}_2_relu")(x)
    x = keras.layers.Conv2D(4 * width, 1, name=f"{name}_3_conv")(x)
    x = keras.layers.BatchNormalization(
        epsilon=1.001e-5, momentum=BN_MOMENTUM, name=f"{name}_3_bn"
    )(x)
    x = keras.layers.Add(name=f"{name}_add")([shortcut, x])
    return keras.layers.Activation("relu", name=f"{name}_out")(x)
