"""Transfer learning and fine-tuning (keras-io's "Transfer learning & fine-tuning"): freeze a base model,
train a new head, then unfreeze, recompile with a low learning rate and train again.

The "pretrained" base is a small BatchNorm CNN trained first on the digits 0-4 (by
worker 0 alone, then saved); the new task is all ten digits. As in the keras-io guide
the base runs with ``training=False``, so its BatchNorm layers stay in inference mode
while fine-tuning. Runs in every mode, unchanged:

    python examples/transfer_learning.py
    pstrain launch --mode async -- python examples/transfer_learning.py

Worker 0 prints one ``RESULT {json}`` line.
"""

import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _report import report  # prints worker 0's RESULT line
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "6"))


def make_base() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
        ],
        name="base",
    )


def make_model(base: keras.Model) -> keras.Model:
    inputs = keras.Input(shape=(8, 8, 1))
    features = base(inputs, training=False)  # BatchNorm in inference mode, also when fine-tuning
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Dropout(0.2)(features))
    return keras.Model(inputs, outputs, name="transfer")


def pretrained_base(x, y) -> keras.Model:
    """The base, trained on the digits 0-4 (the "pretraining" data), cached in a file."""
    path = os.path.join(tempfile.gettempdir(), "psclient-example-base.weights.h5")
    base = make_base()
    if not os.path.exists(path):
        keras.utils.set_random_seed(1)
        head = keras.layers.Dense(5, activation="softmax")
        pre = keras.Sequential([base, head])
        pre.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        pre.fit(x[y < 5], y[y < 5], epochs=3, verbose=0)
        base.save_weights(path + ".tmp.weights.h5")
        os.replace(path + ".tmp.weights.h5", path)
    base.load_weights(path)
    return base


def main() -> None:
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    base = pretrained_base(x_train, y_train)
    dist = psk.from_env()  # dist
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    x_train, y_train = x_train[mine], y_train[mine]  # dist

    base.trainable = False
    model = make_model(base)
    started = time.perf_counter()

    model.compile(
        optimizer=dist.optimizer(keras.optimizers.Adam(1e-3 * dist.lr_scale)),  # dist
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    frozen_accuracy = model.evaluate(x_test, y_test, verbose=0)[1]

    base.trainable = True  # fine-tuning: everything trains, slowly
    model.compile(
        optimizer=dist.optimizer(keras.optimizers.Adam(1e-4 * dist.lr_scale)),  # dist
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist

    def accuracy(m: keras.Model) -> float:
        return float(np.mean(m.predict(x_test, verbose=0).argmax(axis=1) == y_test))

    result = {
        "mode": dist.mode,
        "frozen_accuracy": float(frozen_accuracy),
        "test_accuracy": accuracy(model),
        "train_seconds": time.perf_counter() - started,
    }
    report(dist, result, lambda: make_model(make_base()), accuracy)


if __name__ == "__main__":
    main()
