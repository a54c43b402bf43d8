"""A training loop from scratch with ``tf.GradientTape`` (keras-io's "Writing a training loop from
scratch"), on scikit-learn's digits, with an MLP that has BatchNormalization.

The loop applies the gradients with ``optimizer.apply`` inside a ``tf.function``; the
distributed optimizer does the exchange. Runs in every mode, unchanged:

    python examples/gradient_tape.py
    pstrain launch --mode sync -- python examples/gradient_tape.py

Worker 0 prints one ``RESULT {json}`` line.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _report import report  # prints worker 0's RESULT line
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "10"))


def make_model() -> keras.Model:
    inputs = keras.Input(shape=(64,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name="digits_mlp")


def main() -> None:
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    dist = psk.from_env()  # dist
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    train = tf.data.Dataset.from_tensor_slices((x_train[mine], y_train[mine])).shuffle(2048, seed=0).batch(32)

    model = make_model()
    optimizer = dist.optimizer(keras.optimizers.Adam(1e-3 * dist.lr_scale))  # dist
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist.attach(model, optimizer)  # dist

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    started = time.perf_counter()
    for _ in range(EPOCHS):
        for xb, yb in train:
            train_step(xb, yb)
    dist.finish()  # dist
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        logits = keras.ops.convert_to_numpy(m(x_test, training=False))
        return float(np.mean(logits.argmax(axis=1) == y_test))

    result = {"mode": dist.mode, "test_accuracy": accuracy(model), "train_seconds": seconds}
    report(dist, result, make_model, accuracy)


if __name__ == "__main__":
    main()
