"""A BatchNorm CNN on scikit-learn's digits, in the style of keras-io's image classification examples.

Runs in every mode, unchanged:

    python examples/batchnorm_cnn.py                                   # local
    pstrain launch --mode async -- python examples/batchnorm_cnn.py    # 2 shards + 2 workers
    pstrain launch --mode sync  -- python examples/batchnorm_cnn.py
    pstrain launch --mode allreduce -- python examples/batchnorm_cnn.py

The lines marked ``# dist`` are all that differs from a plain Keras script. Worker 0
prints one ``RESULT {json}`` line: test accuracy, and in the parameter-server modes
the accuracy of a fresh copy of the model loaded from the shards (BatchNorm statistics
included), which must match.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _report import report  # prints worker 0's RESULT line
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "12"))


def make_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Activation("relu"),
            keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Activation("relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_cnn",
    )


def main() -> None:
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    dist = psk.from_env()  # dist
    x_train, y_train = (
        x_train[dist.index :: dist.num_workers],
        y_train[dist.index :: dist.num_workers],
    )  # dist

    model = make_model()
    model.compile(
        optimizer=dist.optimizer(keras.optimizers.Adam(2e-3 * dist.lr_scale)),  # dist
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    started = time.perf_counter()
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        return float(np.mean(m.predict(x_test, verbose=0).argmax(axis=1) == y_test))

    result = {"mode": dist.mode, "test_accuracy": accuracy(model), "train_seconds": seconds}
    report(dist, result, make_model, accuracy)


if __name__ == "__main__":
    main()
