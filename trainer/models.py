"""The seed articles' models: the MNIST CNN and a small ResNet, with explicit layer names.

Explicit names make every variable's Keras path (its name on the shards) the
same on every worker, however many models a process builds.

The MNIST CNN is the classic Keras example (conv 32 -> pool -> conv 64 -> pool
-> dropout -> dense 10) with ``padding="same"``, so it also fits the 8x8 digits
(8x8 -> 4x4 -> 2x2 feature maps) as well as 28x28 MNIST (28 -> 14 -> 7); a
dense hidden layer of 128 is added (``hidden=0`` removes it).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
from keras import layers

MODELS = ("cnn", "resnet", "mlp")


def mnist_cnn(
    input_shape: tuple[int, ...] = (28, 28, 1), num_classes: int = 10, hidden: int = 128
) -> keras.Model:
    """The MNIST convnet, adapted to any input size by same-padding."""
    body = [
        keras.Input(shape=input_shape, name="image"),
        layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1"),
        layers.MaxPooling2D(2, name="pool1"),
        layers.Conv2D(64, 3, padding="same", activation="relu", name="conv2"),
        layers.MaxPooling2D(2, name="pool2"),
        layers.Flatten(name="flatten"),
    ]
    if hidden:
        body.append(layers.Dense(hidden, activation="relu", name="dense1"))
    body += [
        layers.Dropout(0.25, name="dropout"),
        layers.Dense(num_classes, activation="softmax", name="logits"),
    ]
    return keras.Sequential(body, name="cnn")


def small_resnet(
    input_shape: tuple[int, ...] = (28, 28, 1), num_classes: int = 10, width: int = 32
) -> keras.Model:
    """A toy ResNet (the Keras functional-API guide's): conv stem, two residual blocks, global pooling."""
    inputs = keras.Input(shape=input_shape, name="image")
    x = layers.Conv2D(width, 3, padding="same", activation="relu", name="stem_conv")(inputs)
    for i in (1, 2):
        shortcut = x
        y = layers.Conv2D(width, 3, padding="same", activation="relu", name=f"block{i}_conv1")(x)
        y = layers.Conv2D(width, 3, padding="same", name=f"block{i}_conv2")(y)
        x = layers.Activation("relu", name=f"block{i}_out")(layers.Add(name=f"block{i}_add")([shortcut, y]))
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(64, activation="relu", name="dense1")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet")


def mlp(input_shape: tuple[int, ...] = (28, 28, 1), num_classes: int = 10, hidden: int = 256) -> keras.Model:
    """784-256-256-10 on MNIST-sized input (the benchmark's reference model, 269k parameters)."""
    return keras.Sequential(
        [
            keras.Input(shape=input_shape, name="image"),
            layers.Flatten(name="flatten"),
            layers.Dense(hidden, activation="relu", name="dense1"),
            layers.Dense(hidden, activation="relu", name="dense2"),
            layers.Dense(num_classes, activation="softmax", name="logits"),
        ],
        name="mlp",
    )


_BUILDERS: dict[str, Callable[..., keras.Model]] = {"cnn": mnist_cnn, "resnet": small_resnet, "mlp": mlp}


def build(name: str, input_shape: tuple[int, ...], num_classes: int = 10) -> keras.Model:
    """Builds a model by name (``cnn``, ``resnet``, ``mlp``).

    Raises:
        ValueError: unknown name.
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
    return builder(input_shape, num_classes)
