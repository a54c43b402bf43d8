"""The README's ``train.py`` (digits, a two-layer MLP, ``psk.from_env()``) with held-out test images, run by
tests/e2e/test_keras_backends.py on each Keras backend (``KERAS_BACKEND``), unchanged between them.

Worker 0 prints ``RESULT {json}``: the backend, the mode, test accuracy, steps per second after the
first execution, whether the glue imported TensorFlow (``psclient.keras``, ``from_env``, the optimizer
and the callbacks; on JAX and PyTorch the process cannot import it at all), and in the parameter-server
modes the accuracy of a fresh copy of the model loaded from the shards. With ``RING_LOOP=1`` (all-reduce) it
then trains a small model with keras-io's loop from scratch (``_backend_loops.custom_loop``) through an
``AllReduceOptimizer``, each rank on its own batches, and reports whether the ranks' weights ended equal.
"""

import json
import os
import sys
import time

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

EPOCHS = int(os.environ.get("EPOCHS", "8"))


def make_model() -> keras.Model:
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)], name="mlp"
    )


def main() -> None:
    dist = psk.from_env()
    optimizer = dist.optimizer(keras.optimizers.Adam(2e-3 * dist.lr_scale))
    callbacks = dist.callbacks()
    glue_imported_tensorflow = sys.modules.get("tensorflow") is not None
    keras.utils.set_random_seed(0)
    split = load_digits()  # stratified: 1,437 training and 360 test images, flattened for the MLP
    x_train, x_test = split.x_train.reshape(-1, 64), split.x_test.reshape(-1, 64)
    y_train, y_test = split.y_train, split.y_test
    mine = slice(dist.index, None, dist.num_workers)
    model = make_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, metrics=["accuracy"], loss=loss)
    timer = callbacks[-1] if callbacks else None
    started = time.perf_counter()
    if os.environ.get("LR_SCHEDULE") == "1":  # a callback that sets the rate: halved every epoch
        rate = 2e-3 * dist.lr_scale
        callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: rate * 0.5**epoch), *callbacks]
    model.fit(x_train[mine], y_train[mine], batch_size=32, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        scores = keras.ops.convert_to_numpy(m.predict(x_test, verbose=0))
        return float(np.mean(scores.argmax(axis=1) == y_test))

    result = {
        "backend": keras.backend.backend(),
        "mode": dist.mode,
        "test_accuracy": accuracy(model),
        "train_seconds": seconds,
        "steps_per_second": timer.steps_per_second if timer is not None else None,
        "glue_imported_tensorflow": glue_imported_tensorflow,
    }
    if os.environ.get("RING_LOOP") == "1":  # keras-io's loop from scratch on the ring (AllReduceOptimizer)
        import _backend_loops

        net = _backend_loops.mlp("ring_loop")
        ring_optimizer = dist.optimizer(keras.optimizers.SGD(0.1))
        dist.attach(net, ring_optimizer)
        share = slice(dist.index, None, dist.num_workers)  # each rank its own batches: averaged steps
        losses = _backend_loops.custom_loop(
            net, ring_optimizer, _backend_loops.X[share], _backend_loops.Y[share]
        )
        result["ring_loop_losses"] = [losses[0], losses[-1]]
        result["ring_loop_in_sync"] = dist.worker.weights_in_sync(net)
    if dist.mode in psk.MODES:
        fresh = make_model()
        psk.load_from_ps(fresh, dist.worker.client)
        result["loaded_accuracy"] = accuracy(fresh)
        name = dist.worker.name_of(model.trainable_variables[0])
        (piece, *_) = dist.worker.client.list_variables([name])[name]
        result["shard_learning_rate"] = float(piece.spec.optimizer.params["learning_rate"])
        result["learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    if dist.is_chief:
        print("RESULT " + json.dumps(result), flush=True)
    dist.close()


if __name__ == "__main__":
    main()
