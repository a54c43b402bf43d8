"""A custom ``train_step`` (keras-io's "Customizing what happens in fit()") with a frozen layer.

The model overrides ``train_step`` and calls ``self.optimizer.apply_gradients`` itself,
tracks its own loss metric, and has a frozen (``trainable=False``) feature layer,
set from a fixed random projection. Runs in every mode, unchanged:

    python examples/custom_train_step.py
    pstrain launch --mode sync -- python examples/custom_train_step.py

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

EPOCHS = int(os.environ.get("EPOCHS", "15"))


class CustomModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.features = keras.layers.Dense(128, activation="tanh", trainable=False, name="features")
        self.hidden = keras.layers.Dense(64, activation="relu", name="hidden")
        self.classifier = keras.layers.Dense(10, name="classifier")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def call(self, x, training=False):
        return self.classifier(self.hidden(self.features(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, logits)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy.result()}

    def test_step(self, data):
        x, y = data
        self.accuracy.update_state(y, self(x, training=False))
        return {"accuracy": self.accuracy.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]


def make_model() -> CustomModel:
    model = CustomModel(name="custom")
    model(np.zeros((1, 64), "float32"))  # builds the layers
    projection = np.random.default_rng(1).normal(0, 0.25, size=(64, 128)).astype("float32")
    model.features.set_weights([projection, np.zeros(128, "float32")])
    return model


def main() -> None:
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    dist = psk.from_env()  # dist
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    x_train, y_train = x_train[mine], y_train[mine]  # dist

    model = make_model()
    model.compile(optimizer=dist.optimizer(keras.optimizers.SGD(0.05 * dist.lr_scale, momentum=0.9)))  # dist
    started = time.perf_counter()
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        return float(np.mean(keras.ops.convert_to_numpy(m(x_test)).argmax(axis=1) == y_test))

    result = {"mode": dist.mode, "test_accuracy": accuracy(model), "train_seconds": seconds}
    report(dist, result, make_model, accuracy)


if __name__ == "__main__":
    main()
