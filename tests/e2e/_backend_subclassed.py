"""A subclassed model with BatchNorm and its own ``train_step``, written as keras-io's "Customizing what
happens in fit()" writes it for each backend (JAX: a stateless step with ``stateless_call`` and the
optimizer's ``stateless_apply``; PyTorch: ``backward`` and ``optimizer.apply``; TensorFlow: a
``GradientTape``), run by tests/e2e/test_keras_backends.py on JAX and PyTorch locally and under ``pstrain
launch``.

Worker 0 prints ``RESULT {json}``: test accuracy on held-out digits, and in the parameter-server modes
that of a fresh copy loaded from the shards (BatchNorm statistics included).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# On JAX and PyTorch this process runs as an install without TensorFlow would: the glue must not need it,
# and Keras's set_random_seed, which imports TensorFlow whenever it can (2-3 s of CPU a process), seeds
# without it. An import of it raises ImportError here.
if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    sys.modules["tensorflow"] = None  # type: ignore[assignment]

import keras
import numpy as np

import psclient.keras as psk
from trainer.data import load_digits  # scikit-learn's digits, read without importing scikit-learn

EPOCHS = int(os.environ.get("EPOCHS", "3"))
BACKEND = keras.backend.backend()


class DigitsNet(keras.Model):
    """Conv -> BatchNorm -> ReLU -> Dense, with its own loss tracker and train step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)
        self.norm = keras.layers.BatchNormalization(momentum=0.9)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(10)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        h = keras.ops.relu(self.norm(self.conv(x), training=training))
        return self.out(self.hidden(self.flatten(h)))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def _loss(self, y, logits):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    if BACKEND == "jax":

        def compute_loss_and_updates(self, trainable, non_trainable, x, y):
            logits, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            return self._loss(y, logits), non_trainable

        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
            logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
            return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    elif BACKEND == "torch":

        def train_step(self, data):
            import torch

            x, y = data
            self.zero_grad()
            loss = self._loss(y, self(x, training=True))
            loss.backward()
            variables = list(self.trainable_weights)
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in variables], variables)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    else:

        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                loss = self._loss(y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}


def main() -> None:
    dist = psk.from_env()
    keras.utils.set_random_seed(0)
    split = load_digits()  # (N, 8, 8, 1) in [0, 1], stratified: 1,437 training and 360 test images
    x_train, x_test, y_train, y_test = split.x_train, split.x_test, split.y_train, split.y_test
    mine = slice(dist.index, None, dist.num_workers)
    model = DigitsNet(name="digits_net")
    model(x_train[:1])  # built before fit, as keras-io's JAX guide does
    model.compile(optimizer=dist.optimizer(keras.optimizers.Adam(2e-3 * dist.lr_scale)))
    callbacks = dist.callbacks()
    model.fit(x_train[mine], y_train[mine], batch_size=32, epochs=EPOCHS, verbose=0, callbacks=callbacks)

    def accuracy(m: keras.Model) -> float:
        scores = keras.ops.convert_to_numpy(m.predict(x_test, verbose=0))
        return float(np.mean(scores.argmax(axis=1) == y_test))

    result = {"backend": BACKEND, "mode": dist.mode, "test_accuracy": accuracy(model)}
    if dist.mode in psk.MODES:
        fresh = DigitsNet(name="digits_net")
        fresh(x_test[:1])
        psk.load_from_ps(fresh, dist.worker.client)
        result["loaded_accuracy"] = accuracy(fresh)
        result["stale_steps"] = dist.worker.stale_steps
    if dist.is_chief:
        print("RESULT " + json.dumps(result), flush=True)
    dist.close()


if __name__ == "__main__":
    main()
